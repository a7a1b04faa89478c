"""The lean HTTP/1.1 client: keep-alive reuse, Content-Length, chunked and EOF-delimited bodies,
streaming as bytes arrive, timeouts, and closing the connection whenever a response is abandoned."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from bench.fake_upstream import ANSWER, serving_in_thread
from engines.api.client import HttpEngineClient
from engines.api.http1 import ConnectError, HttpPool, ReadTimeout, RemoteProtocolError
from engines.api.protocol import ChatCompletionRequest, ChatMessage

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHAT = msgspec.json.encode({"model": "small", "messages": [{"role": "user", "content": "hi"}]})
STREAMED_CHAT = msgspec.json.encode({"model": "small", "messages": [{"role": "user", "content": "hi"}], "stream": True})


class RawServer:
    """A loopback server whose every connection runs `handler`; counts connections, records EOFs."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.client_closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
        0,
    )
    return await reader.readexactly(length)


@pytest.fixture(scope="module")
def fake_upstream_url() -> AsyncIterator[str]:
    with serving_in_thread() as url:
        yield url


async def test_a_plain_post_returns_status_and_body_and_the_connection_is_reused(fake_upstream_url: str) -> None:
    pool = HttpPool(fake_upstream_url, headers={"content-type": "application/json"})
    try:
        for _ in range(3):
            status, body = await pool.request("POST", "/v1/chat/completions", CHAT)
            assert status == 200
            assert msgspec.json.decode(body)["choices"][0]["message"]["content"] == ANSWER
        assert len(pool._idle) == 1  # three requests, one keep-alive connection
    finally:
        await pool.close()


async def test_a_base_url_path_prefixes_every_request_path(fake_upstream_url: str) -> None:
    pool = HttpPool(f"{fake_upstream_url}/v1/")
    try:
        status, body = await pool.request("GET", "/models")
        assert status == 200
        assert [model["id"] for model in msgspec.json.decode(body)["data"]] == ["small", "large"]
    finally:
        await pool.close()


async def test_a_chunked_event_stream_is_read_line_by_line(fake_upstream_url: str) -> None:
    pool = HttpPool(fake_upstream_url)
    try:
        response = await pool.open("POST", "/v1/chat/completions", STREAMED_CHAT)
        assert response.status == 200
        assert response.header("Content-Type") == "text/event-stream"
        data = [line async for line in response.iter_lines() if line.startswith(b"data:")]
        response.close()
        assert data[-1] == b"data: [DONE]"
        pieces = [msgspec.json.decode(line[5:])["choices"][0]["delta"].get("content") for line in data[:-1]]
        assert "".join(piece for piece in pieces if piece) == ANSWER
        # Read to its end, the stream leaves its connection reusable.
        status, _ = await pool.request("POST", "/v1/chat/completions", CHAT)
        assert status == 200
        assert len(pool._idle) == 1
    finally:
        await pool.close()


async def test_a_stream_is_passed_on_as_it_arrives_not_when_it_ends() -> None:
    second_may_go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        await second_may_go.wait()
        writer.write(b"8\r\ndata: 2\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(handler) as url:
        pool = HttpPool(url, read_timeout=5)
        response = await pool.open("POST", "/events", b"{}")
        lines = response.iter_lines()
        assert await anext(lines) == b"data: 1"  # before the server sends the rest
        second_may_go.set()
        assert [line async for line in lines] == [b"data: 2"]
        response.close()
        await pool.close()


async def test_a_body_split_across_many_packets_is_read_whole() -> None:
    body = b"x" * 100_000

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        for start in range(0, len(body), 7000):
            writer.write(body[start : start + 7000])
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()

    async with RawServer(handler) as url:
        pool = HttpPool(url)
        assert await pool.request("GET", "/big") == (200, body)
        await pool.close()


async def test_a_body_delimited_by_the_end_of_the_connection_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with RawServer(handler) as url:
        pool = HttpPool(url)
        assert await pool.request("GET", "/") == (200, b"until the end")
        assert not pool._idle  # a closed connection is not pooled
        await pool.close()


async def test_a_pooled_connection_the_upstream_closed_is_replaced_before_the_request_is_written() -> None:
    async def answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # keep-alive announced, then closed anyway (an idle timeout upstream)

    server = RawServer(answer_once_then_close)
    async with server as url:
        pool = HttpPool(url)
        assert await pool.request("POST", "/", b"{}") == (200, b"ok")
        await asyncio.sleep(0.05)  # the close reaches the pooled connection
        assert await pool.request("POST", "/", b"{}") == (200, b"ok")
        assert server.connections == 2
        await pool.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = HttpPool(f"http://127.0.0.1:{port}", connect_timeout=1)
    with pytest.raises(ConnectError):
        await pool.request("GET", "/")


async def test_an_upstream_that_does_not_answer_in_time_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with RawServer(silent) as url:
        pool = HttpPool(url, read_timeout=0.2)
        with pytest.raises(ReadTimeout):
            await pool.request("POST", "/", b"{}")
        await pool.close()


async def test_a_connection_lost_mid_body_is_a_protocol_error() -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async with RawServer(truncated) as url:
        pool = HttpPool(url)
        with pytest.raises(RemoteProtocolError):
            await pool.request("GET", "/")
        await pool.close()


async def test_garbage_instead_of_http_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with RawServer(garbage) as url:
        pool = HttpPool(url, read_timeout=2)
        with pytest.raises(RemoteProtocolError):
            await pool.request("GET", "/")
        await pool.close()


async def test_closing_a_stream_before_its_end_closes_the_connection_so_the_upstream_sees_it() -> None:
    upstream_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n8\r\ndata: 1\n\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client closed the connection
        upstream_saw_close.set()

    async with RawServer(endless) as url:
        pool = HttpPool(url)
        response = await pool.open("POST", "/", b"{}")
        assert await anext(response.iter_lines()) == b"data: 1"
        response.close()
        await asyncio.wait_for(upstream_saw_close.wait(), 5)
        assert not pool._idle
        await pool.close()


async def test_cancelling_a_request_closes_its_connection_so_the_upstream_sees_it() -> None:
    upstream_saw_close = asyncio.Event()
    request_arrived = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        request_arrived.set()
        await reader.read()
        upstream_saw_close.set()

    async with RawServer(slow) as url:
        pool = HttpPool(url)
        call = asyncio.create_task(pool.request("POST", "/", b"{}"))
        await asyncio.wait_for(request_arrived.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(upstream_saw_close.wait(), 5)
        await pool.close()


async def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        HttpPool("ftp://example.com")


async def test_concurrent_requests_beyond_max_connections_wait_for_a_free_connection() -> None:
    open_now = 0
    most_open = 0

    async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most_open
        open_now += 1
        most_open = max(most_open, open_now)
        try:
            while True:
                try:
                    await read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                await asyncio.sleep(0.01)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        finally:
            open_now -= 1

    async with RawServer(counting) as url:
        pool = HttpPool(url, max_connections=2)
        answers = await asyncio.gather(*(pool.request("POST", "/", b"{}") for _ in range(6)))
        assert answers == [(200, b"ok")] * 6
        assert most_open == 2
        await pool.close()


async def test_an_engine_client_stream_read_to_its_end_leaves_its_connection_for_the_next_request(
    fake_upstream_url: str,
) -> None:
    client = HttpEngineClient(fake_upstream_url, "small")
    request = ChatCompletionRequest(model="small", messages=[ChatMessage(role="user", content="hi")], stream=True)
    try:
        for _ in range(3):
            chunks = [chunk async for chunk in client.chat_stream(request)]
            assert chunks[-1].usage is not None
        assert client._pool is not None
        assert len(client._pool._idle) == 1
    finally:
        await client.close()
