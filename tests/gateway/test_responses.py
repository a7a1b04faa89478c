"""The Responses API over the chat pipeline: requests translated to chat, answers and streams translated
back. Translation alone here (no HTTP); `test_openai_sdk.py` and `test_tools_sdk.py` serve it to the SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import openai
import pytest
from openai.types.responses import Response

from engines.api.errors import APIError
from engines.api.protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorDetail,
    ErrorResponse,
    Usage,
    sse_event,
)
from gateway.relay import EventStream
from gateway.responses import ResponseShell, ResponsesRequest, from_completion, response_events, to_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "sluice", "input": "Hi", **fields}, ResponsesRequest)


def refusal(**fields: Any) -> APIError:
    with pytest.raises(APIError) as refused:
        to_chat(request(**fields))
    assert refused.value.status_code == 400
    return refused.value


# -- requests -----------------------------------------------------------------------------------------


def test_instructions_and_a_string_input_become_a_system_and_a_user_message() -> None:
    chat = to_chat(request(instructions="Be brief.", input="Hi", max_output_tokens=7, temperature=0))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.stream) == (7, 0, False)


def test_a_conversation_with_calls_and_their_outputs_becomes_chat_turns() -> None:
    chat = to_chat(request(input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                     "text": "Paris and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "25 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Warm in both."}]},
    ], tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert chat.messages[1].content == "Weather in Paris and Rome?"
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("c1", "get_weather", {"city": "Paris"}), ("c2", "get_weather", {"city": "Rome"})]
    assert [(m.tool_call_id, m.content) for m in chat.messages[3:5]] == [("c1", "21 C"), ("c2", "25 C")]
    (tool,) = chat.tools or []
    assert (tool.type, tool.function.name, tool.function.parameters) == ("function", "get_weather",
                                                                         WEATHER["parameters"])
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "get_weather"  # type: ignore[union-attr]


def test_reasoning_effort_verbosity_and_service_tier_take_the_chat_fields_fate() -> None:
    """Forwarded to HTTP tiers, refused by our engines (`engines/api/fields.py`), as in a chat request."""
    chat = to_chat(request(reasoning={"effort": "low"}, text={"verbosity": "low"}, service_tier="flex"))
    assert (chat.reasoning_effort, chat.verbosity, chat.service_tier) == ("low", "low", "flex")


def test_an_answer_passed_back_with_its_text_and_call_is_one_assistant_turn() -> None:
    chat = to_chat(request(input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
    ], tools=[WEATHER]))
    assert [(m.role, m.content, len(m.tool_calls or [])) for m in chat.messages] == [
        ("user", "Weather in Oslo?", 0), ("assistant", "Checking.", 1), ("tool", "3 C", 0)]


@pytest.mark.parametrize(("strict", "expected"), [(None, True), (True, True), (False, False)])
def test_a_function_tool_is_strict_unless_it_says_otherwise(strict: bool | None, expected: bool) -> None:
    """As on OpenAI: a Responses function tool without `strict` holds its calls to the schema; Chat Completions'
    tools do not (their default stays non-strict)."""
    tool = {**WEATHER} if strict is None else {**WEATHER, "strict": strict}
    chat = to_chat(request(tools=[tool]))
    assert chat.tools is not None and chat.tools[0].function.strict is expected


def test_text_format_becomes_response_format_and_logprobs_come_from_include() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat(request(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
                           include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert (chat.response_format.type, chat.response_format.json_schema.schema) == ("json_schema", schema)
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)
    assert chat.stream and chat.stream_options is not None and chat.stream_options.include_usage


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"store": True}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "critic", "content": "no"}]}, "input[0].role"),
    ({"input": []}, "input"),
    # Stateless: a function call's output comes after the call, in the same `input`, and every call has one.
    ({"input": [{"role": "user", "content": "Weather?"},
                {"type": "function_call_output", "call_id": "c1", "output": "3 C"}]}, "input[1].call_id"),
    ({"input": [{"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]}, "input"),
])
def test_what_needs_stored_state_or_other_inputs_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refusal(**fields).param == param


def test_an_unknown_field_is_refused_while_decoding() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        request(frobnicate=True)


# -- answers --------------------------------------------------------------------------------------------


def completion(content: str | None, calls: list[dict[str, Any]] | None = None, finish: str = "stop") -> dict:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "small",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 2}}}


def test_a_completion_becomes_a_response_the_sdk_reads() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = from_completion(ResponseShell(request(tools=[WEATHER])), completion("Checking.", [call]))
    response = Response.model_validate(body)
    assert response.status == "completed" and response.output_text == "Checking."
    assert [item.type for item in response.output] == ["message", "function_call"]
    function_call = response.output[1]
    assert (function_call.call_id, function_call.name, function_call.arguments) == (  # type: ignore[union-attr]
        "call_9", "get_weather", '{"city": "Oslo"}')
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (5, 3)
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert response.id.startswith("resp_") and response.store is False


def test_an_answer_cut_by_max_output_tokens_is_incomplete() -> None:
    body = from_completion(ResponseShell(request()), completion("one two three", finish="length"))
    response = Response.model_validate(body)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


# -- streams --------------------------------------------------------------------------------------------


def chunk(content: str | None = None, calls: list[DeltaToolCall] | None = None, finish: str | None = None,
          usage: Usage | None = None) -> bytes:
    choices = [] if usage else [ChatChunkChoice(index=0, delta=DeltaMessage(content=content, tool_calls=calls),
                                                finish_reason=finish)]
    return sse_event(ChatCompletionChunk(id="c", created=1, model="small", choices=choices, usage=usage))


class Source:
    """A chat SSE stream as the pipeline hands it over, split at arbitrary byte boundaries."""

    def __init__(self, events: list[bytes]) -> None:
        self.data = b"".join(events)
        self.closed = False

    async def events(self) -> AsyncGenerator[bytes, None]:
        try:
            for start in range(0, len(self.data), 7):
                yield self.data[start:start + 7]
        finally:
            self.closed = True


async def stream_events(source: Source, **fields: Any) -> list[dict[str, Any]]:
    raw = b"".join([event async for event in response_events(ResponseShell(request(**fields)),
                                                             EventStream(source.events()))])
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_a_streamed_text_answer_is_the_responses_event_sequence() -> None:
    source = Source([chunk("Hel"), chunk("lo"), chunk(finish="stop"),
                     chunk(usage=Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6)), SSE_DONE])
    events = await stream_events(source)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.usage is not None and final.usage.total_tokens == 6
    assert final.output[0].id == events[2]["item"]["id"] == events[-2]["item"]["id"]
    assert source.closed


async def test_tool_calls_in_fragments_become_function_call_items_after_the_text() -> None:
    first = DeltaToolCall(index=0, id="call_1", type="function",
                          function=DeltaFunctionCall(name="get_weather", arguments='{"ci'))
    rest = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='ty": "Oslo"}'))
    source = Source([chunk("Let me see."), chunk(calls=[first]), chunk(calls=[rest]), chunk(finish="tool_calls"),
                     SSE_DONE])
    events = await stream_events(source, tools=[WEATHER])
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"] == [
        '{"ci', 'ty": "Oslo"}']
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and [item.type for item in final.output] == ["message", "function_call"]
    call = final.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Oslo"}')  # type: ignore[union-attr]


async def test_a_stream_that_fails_midway_ends_with_error_and_response_failed() -> None:
    error = ErrorResponse(error=ErrorDetail(message="The tier stopped answering mid-stream.",
                                            type="service_unavailable_error", code="tier_unavailable"))
    events = await stream_events(Source([chunk("one"), sse_event(error)]))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "tier_unavailable"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None and "tier_unavailable" in failed.error.message


async def test_closing_the_response_stream_before_it_is_read_closes_the_chat_stream() -> None:
    source = Source([chunk("one"), SSE_DONE])
    started = False

    async def chat_events() -> AsyncGenerator[bytes, None]:
        nonlocal started
        started = True
        async for part in source.events():
            yield part

    events = EventStream(response_events(ResponseShell(request()), EventStream(chat_events())))
    await events.aclose()
    assert started  # the pipeline's stream was entered, so that its cleanup (the request's record) ran


def test_the_sdk_types_accept_a_response_object() -> None:
    assert isinstance(openai.types.responses.Response.model_validate(
        from_completion(ResponseShell(request()), completion("x"))), Response)
