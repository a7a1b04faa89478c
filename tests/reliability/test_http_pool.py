"""A slow or stuck upstream (issue #14, items 6 and 9): the HTTP tier pool bounds the wait for a free
connection and the whole request, beside the silence between bytes (read timeout)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from engines.api.http1 import DeadlineExceeded, HttpPool, PoolTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def silent() -> AsyncIterator[str]:
    async def stay_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(30)

    server, url = await _serve(stay_silent)
    yield url
    server.close()


@pytest.fixture
async def trickling() -> AsyncIterator[str]:
    """Answers a head, then one body byte every 50 ms: never silent for long, never done soon."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        for _ in range(1000):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)

    server, url = await _serve(trickle)
    yield url
    server.close()


async def test_waiting_for_a_free_connection_is_bounded(silent: str) -> None:
    pool = HttpPool(silent, max_connections=1, pool_timeout=0.2, read_timeout=30)
    holder = asyncio.create_task(pool.request("GET", "/"))  # takes the only connection, never answered
    await asyncio.sleep(0.05)
    began = time.monotonic()
    with pytest.raises(PoolTimeout):
        await pool.request("GET", "/")
    assert time.monotonic() - began < 2
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await pool.close()


async def test_a_trickling_upstream_hits_the_total_deadline(trickling: str) -> None:
    pool = HttpPool(trickling, read_timeout=5, total_timeout=0.5)
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await pool.request("GET", "/")
    assert time.monotonic() - began < 3  # not the 50 s the body would take, nor a read timeout
    # The slot came back: the pool is usable again (the next request meets the same deadline).
    with pytest.raises(DeadlineExceeded):
        await pool.request("GET", "/")
    await pool.close()
