"""The contract's pieces on their own: the one error type, its reading of msgspec's messages, the
request rules, and the one SSE relay."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec
import pytest

from engines.api.client import EngineUnavailable
from engines.api.errors import APIError, validation_error
from engines.api.protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    DeltaMessage,
    Usage,
)
from engines.api.rules import check_request, decode_request
from engines.api.sse import sse_events


def test_an_error_carries_openais_type_for_its_status_and_its_headers() -> None:
    assert APIError(429, "slow down").type == "rate_limit_error"
    assert APIError(503, "down", headers={"Retry-After": "5"}).headers == {"Retry-After": "5"}
    assert APIError(500, "boom").type == "server_error"
    body = msgspec.json.decode(APIError(400, "bad", param="n", code="invalid_value").body())
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}}


def test_msgspec_messages_become_errors_naming_the_field() -> None:
    nested = validation_error("Expected `str`, got `int` - at `$.messages[0].role`")
    assert (nested.message, nested.param) == ("Expected `str`, got `int`", "messages[0].role")
    assert nested.code == "invalid_type"
    missing = validation_error("Object missing required field `model`")
    assert (missing.param, missing.code) == ("model", "missing_required_parameter")


def test_a_checked_request_passes_and_a_bad_one_names_its_field() -> None:
    check_request(ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="Hi")], n=2))
    with pytest.raises(APIError) as raised:
        check_request(decode_request(b'{"model": "m", "messages": [{"role": "user"}], "stream_options": {}}',
                                     ChatCompletionRequest))  # fmt: skip
    assert raised.value.param == "stream_options"


def chunk(text: str | None, usage: Usage | None = None) -> ChatCompletionChunk:
    choices = [] if text is None else [ChatChunkChoice(index=0, delta=DeltaMessage(content=text))]
    return ChatCompletionChunk(id="c", created=0, model="m", choices=choices, usage=usage)


async def source(*items: ChatCompletionChunk | Exception, closed: list[bool]) -> AsyncGenerator[ChatCompletionChunk]:
    try:
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        closed.append(True)


async def test_the_relay_passes_chunks_drops_unasked_usage_and_ends_with_done() -> None:
    closed: list[bool] = []
    rest = source(chunk(" there"), chunk(None, Usage.of(3, 2)), closed=closed)
    events = [e async for e in sse_events(chunk("Hi"), rest, include_usage=False)]
    assert len(events) == 3 and events[-1] == SSE_DONE and b"usage\":null" in events[1]
    assert closed == [True]
    rest = source(chunk(None, Usage.of(3, 2)), closed=[])
    events = [e async for e in sse_events(chunk("Hi"), rest, include_usage=True)]
    assert b'"prompt_tokens":3' in events[1] and events[-1] == SSE_DONE


async def test_a_stream_failing_midway_ends_with_an_in_band_error_and_closes_its_source() -> None:
    closed: list[bool] = []
    rest = source(chunk(" there"), EngineUnavailable("gone"), closed=closed)
    events = [e async for e in sse_events(chunk("Hi"), rest, include_usage=False)]
    assert len(events) == 3 and b'"code":"tier_unavailable"' in events[-1]
    assert closed == [True]


async def test_closing_the_relay_early_closes_its_source() -> None:
    closed: list[bool] = []
    rest = source(chunk("Hi"), chunk(" there"), chunk(" again"), closed=closed)
    events = sse_events(await anext(rest), rest, include_usage=False)  # the first chunk is awaited before relaying
    await anext(events)
    await events.aclose()
    assert closed == [True]
