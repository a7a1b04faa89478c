"""An engine server killed mid-stream (issue #14, item 9): the client's stream ends at once with an
in-band `tier_unavailable` error, never a hang; the request keeps its one accounting row and is
charged for what was produced before the kill."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.api.client import HttpEngineClient
from gateway.counters import InProcessCounterStore
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from tests.gateway.conftest import chat, make_settings, start

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def upstream_process():
    """The fake upstream as its own process (an event every 200 ms), so that it can be killed."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_upstream", "--port", str(port), "--token-interval-ms", "200"], cwd=ROOT
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield process, f"http://127.0.0.1:{port}"
    if process.poll() is None:
        process.kill()
    process.wait(10)


async def test_a_killed_engine_server_ends_the_stream_cleanly_and_charges_what_was_made(upstream_process):
    process, url = upstream_process
    clients = {name: HttpEngineClient(url, name, read_timeout=5.0) for name in ("small", "large")}
    records: list = []
    settings = make_settings(tier_prices={"price_input_per_mtok": 0.0, "price_output_per_mtok": 1000.0}, fallback=False)
    gateway = Gateway(settings, clients, InProcessCounterStore(), records.append, Metrics())
    try:
        reply = await gateway.chat(await start(gateway), chat(stream=True, max_tokens=16))
        events = [await anext(reply.stream), await anext(reply.stream)]  # the role, then the first words
        process.send_signal(signal.SIGKILL)
        began = time.monotonic()
        async with asyncio.timeout(10):
            events += [event async for event in reply.stream]
        assert time.monotonic() - began < 5  # the connection reset ends it, not a timeout
    finally:
        for client in clients.values():
            await client.close()
    tail = b"".join(events[-2:])
    assert b'"code":"tier_unavailable"' in tail and b"[DONE]" not in tail
    (record,) = records
    assert (record.status, record.error_code) == (200, "tier_unavailable")
    assert 0 < record.completion_tokens < 10 and record.cost_usd > 0  # what was produced, not the whole answer
