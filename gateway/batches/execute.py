"""One batch line through the gateway's request path (the same one `/v1/chat/completions` takes): as
the key that created the batch (its tenant, feature and policy), at `batch` priority (discounted)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.errors import APIError, validation_error
from engines.api.fields import keep_extra_fields
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway import responses
from gateway.auth import Principal
from gateway.batches.store import ClaimedLine
from gateway.batches.wire import ENDPOINTS
from gateway.embeddings import EmbeddingsRequest
from gateway.keys import active_key_by_id, effective_policy
from gateway.pipeline import Gateway, RequestState
from gateway.responses import ResponsesRequest

log = logging.getLogger("sluice.batches")


# Refusals that pass: the line goes back to pending and the worker waits before claiming more (rate limits,
# limits or a tier briefly unavailable). A spent budget or a bad request is the line's answer.
RETRIED_CODES = frozenset({"rate_limit_exceeded", "limits_unavailable", "auth_unavailable", "tier_unavailable"})
DEFAULT_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class LineResult:
    request_id: str
    status_code: int
    body: bytes  # the answer, or an OpenAI error body
    retry_after_s: float | None = None  # set: not an answer; run the line again after this long


def _error_result(request_id: str, error: APIError) -> LineResult:
    if error.code not in RETRIED_CODES and error.status_code != 503:
        return LineResult(request_id, error.status_code, error.body())
    try:
        retry_after_s = float(error.headers.get("Retry-After", DEFAULT_RETRY_S))
    except ValueError:
        retry_after_s = DEFAULT_RETRY_S
    return LineResult(request_id, error.status_code, error.body(), retry_after_s)


LineRunner = Callable[[ClaimedLine], Awaitable[LineResult]]


async def batch_principal(gateway: Gateway, db: AsyncEngine, batch: Any) -> Principal | APIError:
    """Who the batch's lines run as: its key as it is now (policy changes apply; a revoked key runs nothing)."""
    if batch.key_id is None:
        if gateway.settings.server.allow_anonymous:
            return gateway.auth.anonymous()
        return APIError(401, "The batch was created anonymously and anonymous access is off.", code="invalid_api_key")
    key = await active_key_by_id(db, batch.key_id)
    if key is None:
        return APIError(401, "The API key that created this batch has been revoked.", code="invalid_api_key")
    policy = effective_policy(gateway.settings, key.feature, key.policy)
    return Principal(key_id=key.id, tenant=key.tenant, feature=key.feature, policy=policy)


def line_runner(gateway: Gateway, db: AsyncEngine) -> Callable[[Any], Awaitable[LineRunner]]:
    """For a batch: the function that runs one of its lines."""

    async def prepare(batch: Any) -> LineRunner:
        principal = await batch_principal(gateway, db, batch)
        endpoint = ENDPOINTS[batch.endpoint]

        async def run(line: ClaimedLine) -> LineResult:
            return await run_line(gateway, principal, endpoint, f"{batch.id}.{line.line}.{line.attempt}", line)

        return run

    return prepare


async def run_line(gateway: Gateway, principal: Principal | APIError, endpoint: str, request_id: str,
                   line: ClaimedLine) -> LineResult:  # fmt: skip
    # A Responses API line is served as the chat completion it translates to, as over HTTP.
    served_as = responses.SERVED_AS if endpoint == "responses" else endpoint
    state = RequestState(request_id=request_id, endpoint=served_as, response_id=request_id, priority="batch")
    try:
        if isinstance(principal, APIError):
            raise principal
        state.principal = principal
        request = decode_body(endpoint, line.body.encode())
        if isinstance(request, ResponsesRequest):
            return LineResult(request_id, 200, (await responses.serve(gateway, state, request)).body)
        if isinstance(request, EmbeddingsRequest):
            return LineResult(request_id, 200, (await gateway.embeddings(state, request)).body)
        serve = gateway.chat if isinstance(request, ChatCompletionRequest) else gateway.complete
        reply = await serve(state, request)  # type: ignore[arg-type]
        return LineResult(request_id, 200, reply.body)
    except APIError as exc:
        gateway.finish(state, exc.status_code, exc.code)  # once: a no-op when the path already recorded it
        return _error_result(request_id, exc)
    except Exception:
        log.exception("batch request %s failed", request_id)
        gateway.finish(state, 500, "internal_error")
        error = APIError(500, f"The gateway failed to handle the request (request id {request_id}).",
                         code="internal_error")  # fmt: skip
        return LineResult(request_id, 500, error.body())


BatchRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest | EmbeddingsRequest
# What each batch endpoint (`wire.ENDPOINTS`) decodes its lines' bodies as.
BODY_TYPES: dict[str, type[BatchRequest]] = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
                                             "responses": ResponsesRequest, "embeddings": EmbeddingsRequest}


def decode_body(endpoint: str, body: bytes) -> BatchRequest:
    """A line's body as the HTTP endpoint decodes it (unknown fields kept for the same checks)."""
    try:
        request = msgspec.json.decode(body, type=BODY_TYPES[endpoint])
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    if isinstance(request, EmbeddingsRequest):
        return request
    if not isinstance(request, ResponsesRequest):  # which refuses unknown fields while decoding
        keep_extra_fields(request, body)
    if request.stream:
        raise APIError(400, "A batch request cannot stream; drop `stream`.", code="unsupported_parameter",
                       param="stream")  # fmt: skip
    return request
