"""A slow or stuck upstream (issue #14, items 6 and 9): the HTTP tier pool bounds the wait for a free
connection and the whole request, beside the silence between bytes (read timeout); through the gateway,
a tier's `request_timeout_s` ends a stalled call, streamed or not, with a clean error, never a hang."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from engines.api.client import EngineClient
from engines.api.errors import APIError
from engines.api.http1 import DeadlineExceeded, HttpPool, PoolTimeout
from gateway.assembly import build_client
from gateway.counters import InProcessCounterStore
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from tests.gateway.conftest import chat, make_settings, start

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


# -- through the gateway: the tier's configured deadline ends a stalled call with a clean error -------

_FIRST_CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}\n\n'
)


def _piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
async def stalling() -> AsyncIterator[str]:
    """A stalled upstream that never goes silent: a streamed request gets its head and first event,
    then a keep-alive comment every 50 ms; a plain one its head, then a body byte every 50 ms."""

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.read(1 << 16)
        streamed = b'"stream":true' in request
        if streamed:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(_piece(_FIRST_CHUNK))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{")
        try:
            for _ in range(2000):
                writer.write(_piece(b": keep-alive\n\n") if streamed else b" ")
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass  # the gateway gave up: what this test wants

    server, url = await _serve(stall)
    yield url
    server.close()


async def _stalled_gateway(url: str) -> tuple[Gateway, list, dict[str, EngineClient]]:
    settings = make_settings(fallback=False)
    tiers = {name: msgspec.structs.replace(tier, url=url, read_timeout_s=30.0, request_timeout_s=0.5)
             for name, tier in settings.tiers.items()}  # fmt: skip
    settings = msgspec.structs.replace(settings, tiers=tiers)
    clients = {name: build_client(name, tier, settings) for name, tier in tiers.items()}
    records: list = []
    return Gateway(settings, clients, InProcessCounterStore(), records.append, Metrics()), records, clients


async def test_a_stalled_upstream_is_cut_at_the_request_deadline_with_a_clean_error(stalling: str) -> None:
    gateway, records, clients = await _stalled_gateway(stalling)
    try:
        began = time.monotonic()
        with pytest.raises(APIError) as caught:
            await gateway.chat(await start(gateway), chat())
        assert time.monotonic() - began < 3  # the 0.5 s deadline, not the 30 s read timeout nor 100 s of body
        assert (caught.value.status_code, caught.value.code) == (503, "tier_unavailable")
        assert caught.value.headers["Retry-After"]
    finally:
        for client in clients.values():
            await client.close()
    (record,) = records
    assert (record.status, record.error_code) == (503, "tier_unavailable")


async def test_a_stalled_stream_is_cut_at_the_request_deadline_with_an_in_band_error(stalling: str) -> None:
    gateway, records, clients = await _stalled_gateway(stalling)
    try:
        began = time.monotonic()
        reply = await gateway.chat(await start(gateway), chat(stream=True))
        assert reply.stream is not None
        async with asyncio.timeout(10):
            events = [event async for event in reply.stream]
        assert time.monotonic() - began < 3
    finally:
        for client in clients.values():
            await client.close()
    body = b"".join(events)
    assert b'"content":"Hi"' in body  # what came before the stall was relayed
    error = msgspec.json.decode(body.rsplit(b"data: ", 1)[1])["error"]
    assert error["code"] == "tier_unavailable"
    assert b"[DONE]" not in body
    (record,) = records
    assert record.error_code == "tier_unavailable"
