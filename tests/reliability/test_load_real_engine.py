"""Load held on a real engine (issue #14, item 9): 64 concurrent streaming clients through the gateway's
HTTP server (uvicorn, on loopback, in this process) against an in-process tier of the `tiny` demo model.
Every eighth client leaves after its first events (the engine must abort its sequence); every other
stream must end in `[DONE]` with no error. Afterwards this process holds no more file descriptors than
before, and the engine's block manager has every KV block free again (none leaked by a finished or cut
sequence). Bounded: the load itself must take at most 60 s."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn

from engines.serving import InProcessEngineClient
from gateway.app import create_app
from gateway.assembly import build_client
from gateway.config import PolicyConfig, TierConfig, load_settings

TINY_GGUF = Path("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
CLIENTS = 64
LEAVES_EARLY = 8  # every eighth client disconnects mid-stream
MAX_TOKENS = 16
LOAD_BUDGET_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _stream(client: httpx.AsyncClient, number: int) -> str | None:
    """One streamed chat completion; None when it ended cleanly (or, for a client that leaves early,
    when its first events came), else what went wrong."""
    body = {
        "model": "sluice",
        "messages": [{"role": "user", "content": f"Story {number}: tell me about a robot who reads."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}: {(await response.aread())[:200]!r}"
        events: list[str] = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
            if number % LEAVES_EARLY == LEAVES_EARLY - 1 and len(events) == 2:
                return None  # leaving: the connection closes with the response
    if not events or events[-1] != "data: [DONE]":
        return f"no [DONE]: {events[-1:]!r}"
    if errors := [event for event in events if '"error"' in event]:
        return f"in-band error: {errors[0][:200]}"
    return None


@pytest.mark.timeout(240)  # loading the model and a cold start on a busy machine, plus the 60 s load
async def test_sixty_four_streams_on_the_tiny_engine_no_errors_no_fd_growth_no_leaked_kv_blocks() -> None:
    if not TINY_GGUF.is_file():
        pytest.skip(f"{TINY_GGUF} is absent; fetch it with `sluice models fetch tiny`")
    base = load_settings(environ={})
    # Every client runs at once (no queueing past max_num_seqs); KV room for all of them.
    tier = TierConfig(model="tiny", max_num_seqs=CLIENTS, kv_cache_mb=128, max_model_len=512, request_timeout_s=120)
    anonymous = {"allow_anonymous": True, "anonymous_rpm": 0, "anonymous_tpm": 0, "anonymous_spend_per_day_usd": 0.0}
    settings = msgspec.structs.replace(
        base,
        server=msgspec.structs.replace(base.server, **anonymous),
        database=msgspec.structs.replace(base.database, url="sqlite+aiosqlite:///:memory:"),
        tiers={"small": tier},
        policies={"default": PolicyConfig(allowed_tiers=["small"])},
    )
    engine_client = await asyncio.to_thread(build_client, "small", tier, settings)
    assert isinstance(engine_client, InProcessEngineClient)
    block_manager = engine_client.serving.engine.engine.block_manager
    records: list = []
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, tiers={"small": engine_client}, record_sink=records.append),
            host="127.0.0.1",
            port=port,
            http="httptools",
            log_level="warning",
            access_log=False,
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the server did not start"
            await asyncio.sleep(0.05)
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as client:
            assert await _stream(client, -1) is None  # warm-up: lazy imports, first compiled kernels
        await asyncio.sleep(0.2)
        free_blocks, fds = block_manager.num_free_blocks, _open_fds()

        began = time.monotonic()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as client:
            outcomes = await asyncio.gather(*(_stream(client, number) for number in range(CLIENTS)))
        took = time.monotonic() - began

        for _ in range(100):  # the engine frees a finished sequence's blocks on its next step
            if block_manager.num_free_blocks == free_blocks:
                break
            await asyncio.sleep(0.05)
        for _ in range(100):  # the server closes a connection once it has seen the client's close
            if _open_fds() <= fds:
                break
            await asyncio.sleep(0.05)
        free_after, fds_after = block_manager.num_free_blocks, _open_fds()
        aborted = engine_client.serving.engine.stats().num_aborted_total
    finally:
        server.should_exit = True
        await serving
        await engine_client.close()
    errors = [outcome for outcome in outcomes if outcome is not None]
    assert errors == [], errors[:3]
    assert took <= LOAD_BUDGET_S, f"{CLIENTS} streams took {took:.1f} s"
    assert free_after == free_blocks, f"{free_blocks - free_after} KV blocks leaked"
    assert fds_after <= fds, f"descriptors grew from {fds} to {fds_after}"
    left = CLIENTS // LEAVES_EARLY
    print(f"\n{CLIENTS} streams ({left} left early, {aborted} aborted) in {took:.1f} s; "
          f"descriptors {fds} -> {fds_after}; free KV blocks {free_blocks} -> {free_after} of "
          f"{block_manager.num_blocks}")  # fmt: skip
    assert len(records) == CLIENTS + 1  # each stream accounted once, the warm-up too
    assert sum(record.status == 200 for record in records) >= CLIENTS + 1 - left
    assert all(0 < record.completion_tokens <= MAX_TOKENS for record in records)
