"""A lean Redis client for the request path: one connection shared by every request, commands
pipelined as they come, replies parsed by hiredis.

redis-py's asyncio client checks a connection out of its pool and takes a lock per command; an
admission here is one write and one read on a connection every request shares. Only what the
counters need: connect (host or unix socket, AUTH, SELECT), send a command, run a Lua script by
its SHA (sending the source once when Redis forgot it). Anything else goes through redis-py.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Mapping
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError


def _settled(timer: asyncio.TimerHandle, reply: asyncio.Future[Any]) -> None:
    timer.cancel()
    if not reply.cancelled():
        reply.exception()  # retrieved: a batch that failed early leaves later replies unread


class MultiplexedConnection(asyncio.Protocol):
    """One Redis connection shared by every request: each command is written as it comes and its
    reply matched to it in order (Redis answers in order). No connection checkout, no lock, and
    commands of concurrent requests share packets."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = hiredis.Reader()
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        while (reply := self._parser.gets()) is not False:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue  # its caller timed out or was cancelled
            if isinstance(reply, hiredis.ReplyError):
                waiter.set_exception(ResponseError(str(reply)))
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"Redis connection lost: {exc or 'closed by the server'}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, *args: str | int | float | bytes, timeout: float) -> asyncio.Future[Any]:
        """Write one command now; the future gets its reply. Commands sent before awaiting any of
        them go out together. A timeout closes the connection: its replies no longer line up."""
        if self.closed or self.transport is None:
            raise ConnectionError("Redis connection is closed")
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        self.transport.write(hiredis.pack_command(args))
        timer = loop.call_later(timeout, self._time_out, waiter)
        waiter.add_done_callback(functools.partial(_settled, timer))
        return waiter

    async def call(self, *args: str | int | float | bytes, timeout: float) -> Any:
        return await self.send(*args, timeout=timeout)

    def _time_out(self, waiter: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError("Redis did not answer in time"))
            self.close()


class MultiplexedRedis:
    """The one multiplexed connection of a redis-py client's settings, reopened when it closed."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self._settings = settings
        self._connection: MultiplexedConnection | None = None
        self._connecting = asyncio.Lock()

    @classmethod
    def of(cls, redis: Redis) -> MultiplexedRedis | None:
        """For a plain TCP or unix-socket client; None for others (TLS), which stay on redis-py."""
        pool = redis.connection_pool
        if pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        return cls(pool.connection_kwargs)

    @property
    def timeout(self) -> float:
        return self._settings.get("socket_timeout") or 5.0

    async def connection(self) -> MultiplexedConnection:
        connection = self._connection
        if connection is not None and not connection.closed:
            return connection
        async with self._connecting:
            if self._connection is None or self._connection.closed:
                self._connection = await self._open()
            return self._connection

    async def _open(self) -> MultiplexedConnection:
        settings = self._settings
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(settings.get("socket_connect_timeout") or 5.0):
            if settings.get("path"):
                _, connection = await loop.create_unix_connection(MultiplexedConnection, settings["path"])
            else:
                host, port = settings.get("host", "localhost"), settings.get("port", 6379)
                _, connection = await loop.create_connection(MultiplexedConnection, host, port)
            try:
                await self._handshake(connection)
            except BaseException:
                connection.close()
                raise
        return connection

    async def _handshake(self, connection: MultiplexedConnection) -> None:
        settings, timeout = self._settings, self.timeout
        if settings.get("password"):
            username = [settings["username"]] if settings.get("username") else []
            await connection.call("AUTH", *username, settings["password"], timeout=timeout)
        if settings.get("db"):
            await connection.call("SELECT", settings["db"], timeout=timeout)

    async def run_scripts(self, script: AsyncScript, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run `script` once per (keys, args), all sent before the first reply is awaited."""
        connection = await self.connection()
        timeout = self.timeout
        sent = [
            connection.send("EVALSHA", script.sha, len(keys), *keys, *args, timeout=timeout) for keys, args in calls
        ]
        replies: list[Any] = []
        for (keys, args), reply in zip(calls, sent, strict=True):
            try:
                replies.append(await reply)
            except ResponseError as exc:
                if not str(exc).startswith("NOSCRIPT"):
                    raise
                # Redis restarted or its scripts were flushed: send the script itself (cached again).
                replies.append(await connection.call("EVAL", script.script, len(keys), *keys, *args, timeout=timeout))
        return replies

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
