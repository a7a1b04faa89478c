"""A gateway in its own process for the kill test: `python -m tests.gateway.batch_server DB_URL DIR PORT [FREE]`.
Its small tier is scripted and slow (each answer takes `ANSWER_S`); given FREE, it answers that many calls
and hangs every later one, so that a kill finds exactly the lines in flight the test expects."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import uvicorn

from engines.api.protocol import ChatCompletion, ChatCompletionRequest
from gateway.app import create_app
from gateway.config import BatchConfig
from tests.gateway.conftest import make_settings
from tests.gateway.scripted_tier import ScriptedTier

ANSWER_S = 0.05
LEASE_S = 1.0


class SlowTier(ScriptedTier):
    def __init__(self, name: str, free: int | None) -> None:
        super().__init__(name)
        self.free = free
        self.calls = 0

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        self.calls += 1
        if self.free is not None and self.calls > self.free:
            await asyncio.Event().wait()  # until the process is killed
        await asyncio.sleep(ANSWER_S)
        return await super().chat(request)


def main(database_url: str, directory: str, port: int, free: int | None) -> None:
    settings = make_settings(database_url=database_url)
    settings = msgspec.structs.replace(settings, batch=BatchConfig(dir=directory, lease_s=LEASE_S, concurrency=2))
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(
        settings.server, spool_dir=str(Path(directory) / "spool")))  # fmt: skip
    app = create_app(settings, {"small": SlowTier("small", free), "large": ScriptedTier("large")})
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
