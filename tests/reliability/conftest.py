"""Fault injection needs servers this suite may stop: a private Redis per test, on its own port,
never the shared one other runs use."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SUITE_TIMEOUT_S = 120


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is bounded: a hang is a failure, not a stuck CI job."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SUITE_TIMEOUT_S))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A throwaway redis-server that a test can stop and start again on the same port."""

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, *, save: bool = False) -> None:
        """Stop the server; with `save`, its data is written first and read back by the next `start`
        (a Redis that restarts with its counters)."""
        if self.process is not None:
            if save:
                subprocess.run(["redis-cli", "-p", str(self.port), "SHUTDOWN", "SAVE"], capture_output=True)
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
