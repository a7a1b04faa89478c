"""The stream relay of the gateway: a tier's chunks to the client as server-sent events (through
the contract's one relay, `engines.api.sse`), watched for what the request is accounted by.

However the stream ends (read to the end, failed midway, abandoned by the client, or closed before
it was read at all) the tier's stream is closed, which cancels its work, and `on_end` runs once
with what was produced.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import suppress

import anyio

from engines.api.protocol import ChatCompletionChunk, Chunk, ErrorDetail, Usage
from engines.api.sse import close, sse_events


class PassingStream:
    """`held` chunks (read from the tier already), then the rest of the tier's stream, `see` called on each
    chunk as it passes. Closing it closes the tier's stream, also when it was never read: a generator closed
    before its first step skips its cleanup, and the tier would go on generating for a client that left."""

    def __init__(self, rest: AsyncIterator[Chunk], see: Callable[[Chunk], object] | None = None,
                 held: Iterable[Chunk] = ()) -> None:  # fmt: skip
        self._held = deque(held)
        self._rest, self._see = rest, see

    def __aiter__(self) -> PassingStream:
        return self

    async def __anext__(self) -> Chunk:
        chunk = self._held.popleft() if self._held else await anext(self._rest)
        if self._see is not None:
            self._see(chunk)
        return chunk

    async def aclose(self) -> None:
        await close(self._rest)


class StreamAccount:
    """What a relayed stream produced: its usage (when the tier sent it), its text, chunk times,
    and the error it ended with."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.texts: list[str] = []
        self.chunk_times: list[float] = []
        self.error_code: str | None = None

    def chunk(self, chunk: Chunk) -> None:
        self.chunk_times.append(time.perf_counter())
        if chunk.usage is not None:
            self.usage = chunk.usage
        self.texts.extend(chunk_texts(chunk))

    def failed(self, detail: ErrorDetail) -> None:
        self.error_code = detail.code or "stream_failed"

    def itl_ms_mean(self) -> float | None:
        """Mean time between chunks, in milliseconds."""
        times = self.chunk_times
        return (times[-1] - times[0]) * 1000 / (len(times) - 1) if len(times) > 1 else None


def chunk_texts(chunk: Chunk) -> list[str]:
    if isinstance(chunk, ChatCompletionChunk):
        return [c.delta.content for c in chunk.choices if c.delta.content]
    return [c.text for c in chunk.choices if c.text]


async def relay(
    first: Chunk, rest: AsyncIterator[Chunk], include_usage: bool, on_end: Callable[[StreamAccount], None]
) -> AsyncGenerator[bytes, None]:
    account = StreamAccount()
    events = sse_events(first, rest, include_usage, account)
    try:
        async for event in events:
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()  # closes the tier's stream
        on_end(account)


class EventStream:
    """The server-sent events of a streamed reply. `aclose` finishes the request also when the
    stream is closed before it was read: a plain generator closed before its first step would skip
    its cleanup."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events
        self._started = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        self._started = True
        return await anext(self._events)

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            with suppress(StopAsyncIteration):
                await anext(self._events)  # enter the generator so that its cleanup runs
        await self._events.aclose()
