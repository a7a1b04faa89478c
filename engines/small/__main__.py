"""`python -m engines.small [--host H] [--port P] [--model M] ...`: serve the small tier over HTTP."""

from engines.server import launch
from engines.small.spec import SPEC

if __name__ == "__main__":
    launch(SPEC)
