"""`python -m engines.large [--host H] [--port P] [--model M] ...`: serve the large tier over HTTP."""

from engines.large.spec import SPEC
from engines.server import launch

if __name__ == "__main__":
    launch(SPEC)
