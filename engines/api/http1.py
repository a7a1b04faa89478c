"""A lean HTTP/1.1 client for calling upstreams on the hot path: a keep-alive connection pool per
upstream on `asyncio.Protocol`, responses parsed by `httptools` (Content-Length, chunked, or read
to EOF), bodies streamed piece by piece as they arrive.

What it does not do, on purpose: redirects, cookies, proxies, TLS verification knobs, HTTP/2. One
request per connection at a time (no pipelining).

    pool = HttpPool("http://127.0.0.1:8001", headers={"content-type": "application/json"})
    status, body = await pool.request("POST", "/v1/chat/completions", payload)
    response = await pool.open("POST", "/v1/chat/completions", payload)   # headers received
    try:
        async for line in response.iter_lines(): ...
    finally:
        response.close()   # early close drops the connection: the upstream sees the disconnect

Failures are `HttpClientError`s: `ConnectError` (could not connect in time), `PoolTimeout` (no free
connection within `pool_timeout`), `ReadTimeout` (nothing arrived for `read_timeout` seconds),
`DeadlineExceeded` (the whole request, head to last body byte, streamed or not, took longer than
`total_timeout`), `RemoteProtocolError` (connection lost or garbage mid-response).
A pooled connection found closed before the request was written is replaced once, transparently;
a request that was written is never sent twice (POSTs are not idempotent).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

# Stop reading from the socket while this much body is buffered and unread (a slow consumer).
HIGH_WATER_BYTES = 1 << 20


class HttpClientError(Exception):
    """The exchange with the upstream failed; no (complete) response is available."""


class ConnectError(HttpClientError):
    """The connection could not be opened (refused, unreachable, or not within connect_timeout)."""


class ReadTimeout(HttpClientError):
    """The upstream sent nothing for read_timeout seconds."""


class PoolTimeout(HttpClientError):
    """Every connection stayed busy for the whole connection-wait timeout."""


class DeadlineExceeded(HttpClientError):
    """The whole request (send, head and body) took longer than its total deadline."""


class RemoteProtocolError(HttpClientError):
    """The connection closed mid-response, or the upstream sent something that is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the parser state of the response being received on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_complete = False
        self.message_complete = False
        self.keep_alive = False
        self.received_any = False
        self.error: HttpClientError | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"invalid HTTP response: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        # A body delimited by the end of the connection (neither Content-Length nor chunked) ends here.
        if self.headers_complete and not self.message_complete and not self._has_framing():
            self.message_complete = True
            self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.message_complete:
            reason = f": {exc}" if exc else ""
            self._fail(RemoteProtocolError(f"connection closed before the response was complete{reason}"))
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.message_complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- used by the pool and responses -----------------------------------------------------------

    def _has_framing(self) -> bool:
        return any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _fail(self, error: HttpClientError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timeout(self, past_deadline: bool) -> None:
        if past_deadline:
            self._fail(DeadlineExceeded("the request ran past its total deadline"))
        else:
            self._fail(ReadTimeout("the upstream sent nothing in time"))
        self._wake()

    async def wait(self, read_timeout: float, deadline: float = math.inf) -> None:
        """Until something happens on the connection, or `read_timeout` passes (`ReadTimeout`), or
        the loop's clock reaches `deadline` (`DeadlineExceeded`)."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            self._fail(DeadlineExceeded("the request ran past its total deadline"))
            raise self.error  # type: ignore[misc]
        self._waiter = loop.create_future()
        timer = loop.call_later(min(read_timeout, left), self._on_timeout, left <= read_timeout)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take_body(self) -> bytes:
        data = b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A response whose head has arrived; the body is read with `read`, `iter_bytes` or
    `iter_lines`. `close()` gives the connection back when the body was read to its end, and
    closes it otherwise (so that the upstream sees the disconnect and stops its work)."""

    def __init__(self, pool: HttpPool, connection: _Connection, deadline: float) -> None:
        self._pool = pool
        self._connection = connection
        self._deadline = deadline  # loop time by which the whole body must have arrived
        self.status = connection.status
        self.headers = connection.headers
        self._released = False

    def header(self, name: str) -> str | None:
        key = name.lower().encode("latin-1")
        for header, value in self.headers:
            if header == key:
                return value.decode("latin-1")
        return None

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive (chunked framing removed)."""
        connection = self._connection
        try:
            while True:
                if connection.body:
                    yield connection.take_body()
                    continue
                if connection.message_complete:
                    return
                await connection.wait(self._pool.read_timeout, self._deadline)
        except BaseException:
            self.close()
            raise

    async def iter_lines(self) -> AsyncIterator[bytes]:
        """Body lines without their line ending (`\\n` or `\\r\\n`), each as soon as it is complete."""
        pending = b""
        async for data in self.iter_bytes():
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line[:-1] if line.endswith(b"\r") else line
        if pending:
            yield pending

    async def read(self) -> bytes:
        """The whole body; the connection is given back."""
        pieces = [piece async for piece in self.iter_bytes()]
        self.close()
        return b"".join(pieces)

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        connection = self._connection
        if not (connection.message_complete and connection.keep_alive and not connection.body):
            connection.abort()
        self._pool._release(connection)


class HttpPool:
    """Keep-alive HTTP/1.1 connections to one upstream (`base_url`: scheme, host, port and a path
    prefix that every request path is appended to), at most `max_connections` at a time."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 120.0,
        max_connections: int = 256,
        pool_timeout: float = 5.0,
        total_timeout: float = 600.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s):// URL with a host, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout  # the most silence between bytes
        self.pool_timeout = pool_timeout  # the longest wait for a free connection
        self.total_timeout = total_timeout  # the longest a whole request may take, streamed or not
        authority = parts.netloc.rsplit("@", 1)[-1]
        # Every request carries the same headers: encoded once, here.
        fixed = {"host": authority, "user-agent": "sluice", **{k.lower(): v for k, v in (headers or {}).items()}}
        self._head_suffix = "".join(f"{name}: {value}\r\n" for name, value in fixed.items()).encode("latin-1")
        self._idle: deque[_Connection] = deque()
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    def _request_bytes(self, method: str, path: str, body: bytes) -> bytes:
        start = f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode("latin-1")
        return b"%s%scontent-length: %d\r\n\r\n%s" % (start, self._head_suffix, len(body), body)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl or None)
        except TimeoutError as exc:
            raise ConnectError(f"could not connect to {self.host}:{self.port} in {self.connect_timeout} s") from exc
        except OSError as exc:
            raise ConnectError(f"could not connect to {self.host}:{self.port}: {exc}") from exc
        return connection

    def _release(self, connection: _Connection) -> None:
        self._slots.release()
        if connection.reusable() and not self._closed:
            connection._reset()
            self._idle.append(connection)

    async def _send(self, data: bytes) -> _Connection:
        """Write the request on an idle connection (a closed one is dropped and the next tried) or
        a new one. Nothing is retried once written."""
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable() and not connection.received_any:
                assert connection.transport is not None
                connection.transport.write(data)
                return connection
            connection.abort()  # closed by the upstream, or sent something unasked for
        connection = await self._connect()
        assert connection.transport is not None
        connection.transport.write(data)
        return connection

    async def open(self, method: str, path: str, body: bytes = b"") -> Response:
        """Send a request and wait for the response head. The caller must `close()` the response. Its
        body too must have arrived within `total_timeout` of this call."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        deadline = asyncio.get_running_loop().time() + self.total_timeout
        try:
            async with asyncio.timeout(self.pool_timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise PoolTimeout(f"no free connection to {self.host}:{self.port} within {self.pool_timeout} s") from exc
        connection: _Connection | None = None
        try:
            connection = await self._send(self._request_bytes(method, path, body))
            while not connection.headers_complete:
                await connection.wait(self.read_timeout, deadline)
        except BaseException:
            # Cancelled or failed: the upstream sees the connection close and stops its work.
            if connection is not None:
                connection.abort()
            self._slots.release()
            raise
        return Response(self, connection, deadline)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send a request and read the whole response: (status, body), within the total deadline."""
        response = await self.open(method, path, body)
        return response.status, await response.read()

    async def close(self) -> None:
        """Close the idle connections; connections in use close when their response is closed."""
        self._closed = True
        while self._idle:
            self._idle.pop().abort()
