"""The one SSE relay: a stream of chunks as OpenAI's server-sent events, for the engine server and
the gateway alike.

Chunks pass through as they come; the usage the client did not ask for is dropped; the stream ends
with `data: [DONE]`, or, when it fails after the status line was sent, with an in-band error event
(as OpenAI reports it). However it ends, the source stream is closed, which aborts its work.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

import anyio

from engines.api.client import EngineUnavailable
from engines.api.errors import APIError
from engines.api.protocol import SSE_DONE, ChatCompletionChunk, Completion, ErrorDetail, ErrorResponse, sse_event

Chunk = ChatCompletionChunk | Completion

log = logging.getLogger(__name__)


class StreamObserver(Protocol):
    """Watches a relayed stream (the gateway accounts from it)."""

    def chunk(self, chunk: Chunk) -> None:
        """A chunk arrived (before its usage is dropped for a client that did not ask for it)."""

    def failed(self, detail: ErrorDetail) -> None:
        """The stream failed after it had started; `detail` is what the client is told."""


async def sse_events(
    first: Chunk, rest: AsyncIterator[Chunk], include_usage: bool, observer: StreamObserver | None = None
) -> AsyncGenerator[bytes, None]:
    """`first` and then `rest` as server-sent events. Closing this generator closes `rest`."""
    chunk: Chunk | None = first
    try:
        while chunk is not None:
            if observer is not None:
                observer.chunk(chunk)
            if not include_usage:
                chunk.usage = None
            if chunk.choices or chunk.usage is not None:
                yield sse_event(chunk)
            chunk = await anext(rest, None)
        yield SSE_DONE
    except Exception as exc:
        detail = stream_error(exc)
        if observer is not None:
            observer.failed(detail)
        yield sse_event(ErrorResponse(error=detail))
    finally:
        with anyio.CancelScope(shield=True):
            await close(rest)


def stream_error(exc: Exception) -> ErrorDetail:
    """What a client is told about a stream that failed midway."""
    if isinstance(exc, APIError):
        return exc.detail
    if isinstance(exc, EngineUnavailable):
        return ErrorDetail(
            message="The tier stopped answering mid-stream.", type="service_unavailable_error", code="tier_unavailable"
        )
    log.exception("stream failed", exc_info=exc)
    return ErrorDetail(message="The stream failed.", type="server_error", code="stream_failed")


async def close(stream: AsyncIterator[object]) -> None:
    """Close a stream that may be an async generator (aborting its work) or a plain iterator."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
