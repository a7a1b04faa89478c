"""What the controllers share: the gateway from app state, replies as responses, SSE streams that
always close their source."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from anyio import CancelScope
from litestar import Request, Response
from litestar.datastructures import State
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Scope, Send

from engines.api.errors import APIError
from gateway.pipeline import CLIENT_CLOSED_REQUEST, Gateway, Reply

_T = TypeVar("_T")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request[Any, Any, Any], work: Awaitable[_T]) -> _T:
    """Await `work` (the body has been read), cancelling it if the client disconnects meanwhile, so
    that an abandoned request stops its upstream call instead of finishing for nobody. The work runs
    in the handler's own task (no extra task, no extra loop turns); a watcher cancels that task."""
    handler = asyncio.current_task()
    assert handler is not None
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    watcher.add_done_callback(lambda done: None if done.cancelled() else handler.cancel())
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # cancelled from outside (shutdown), not by the client leaving
        handler.uncancel()
        # Nobody reads this answer; raising ends the request the way every failure ends (one record).
        raise APIError(
            CLIENT_CLOSED_REQUEST, "The client closed the request.", code="client_disconnected"
        ) from None
    finally:
        watcher.cancel()


def provide_gateway(state: State) -> Gateway:
    return state.gateway


class _ClosingStreamingResponse(ASGIStreamingResponse):
    """Litestar's streaming response stops sending when the client disconnects but leaves the
    source suspended until garbage collection; closing it here cancels the upstream request at once
    and lets the pipeline charge what was produced, also when sending failed before the body."""

    __slots__ = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.iterator, "aclose", None)
            if aclose is not None:
                with CancelScope(shield=True):
                    await aclose()


class SSEResponse(Stream):
    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIStreamingResponse:
        response = super().to_asgi_response(*args, **kwargs)
        response.__class__ = _ClosingStreamingResponse
        return response


def reply_response(reply: Reply) -> Response[Any]:
    if reply.stream is not None:
        headers = {**reply.headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        return SSEResponse(reply.stream, media_type="text/event-stream", headers=headers)
    return Response(reply.body, media_type="application/json", headers=reply.headers)


def bearer(request: Request[Any, Any, Any]) -> str | None:
    return request.headers.get("authorization")
