"""Tool calling and structured outputs through the gateway, with the official `openai` SDK, on the real
small demo model (Qwen2.5-Coder-0.5B-Instruct: its own chat template renders the tools). Forced
`tool_choice` and JSON schemas go through constrained decoding, so the answers are deterministic in
shape; replies are kept to a few dozen tokens."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import jsonschema
import msgspec
import openai
import pytest

from engines.registry import resolve_model
from gateway.app import create_app
from gateway.config import PolicyConfig, TierConfig, load_settings
from tests.gateway.conftest import loopback_socket, served_on

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _serve(cache: str) -> Iterator[openai.OpenAI]:
    try:
        resolve_model("small")
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test fetches it)")
    base = load_settings(environ={})
    settings = msgspec.structs.replace(
        base,
        server=msgspec.structs.replace(base.server, allow_anonymous=True),
        database=msgspec.structs.replace(base.database, url="sqlite+aiosqlite:///:memory:"),
        tiers={"small": TierConfig(model="small", kv_cache_mb=64, max_num_seqs=4, max_model_len=2048)},
        policies={"default": PolicyConfig(allowed_tiers=["small"], cache=cache)},
    )
    with served_on(create_app(settings), loopback_socket(), wait_s=30) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0)


@pytest.fixture(scope="module")
def sdk() -> Iterator[openai.OpenAI]:
    yield from _serve(cache="off")


@pytest.fixture(scope="module")
def cached_sdk() -> Iterator[openai.OpenAI]:
    yield from _serve(cache="exact")


def test_a_named_tool_choice_returns_a_parsed_tool_call(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="sluice-small", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments["city"] == "Paris" and arguments["unit"] == "celsius"  # the model reads the question


def test_a_required_tool_call_streams_as_tool_call_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="sluice-small", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40,
        temperature=0, stream=True,
    )
    chunks = list(stream)
    deltas = [d for c in chunks for choice in c.choices for d in (choice.delta.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_tool_call_answered_from_the_cache_keeps_its_calls_as_json_and_as_a_stream(cached_sdk: openai.OpenAI) -> None:
    ask = {"model": "sluice-small", "messages": ASK, "tools": [WEATHER], "max_tokens": 40, "temperature": 0,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}

    def streamed() -> tuple[str | None, list[tuple[str, str]]]:
        raw = cached_sdk.chat.completions.with_raw_response.create(stream=True, **ask)
        deltas = [d for c in raw.parse() for choice in c.choices for d in (choice.delta.tool_calls or [])]
        return raw.headers.get("x-sluice-cache"), [(d.function.name or "", d.function.arguments or "")
                                                   for d in deltas if d.function]

    status, original = streamed()  # kept from the stream, in the background
    assert status == "miss" and original and original[0][0] == "get_weather"
    time.sleep(0.5)
    raw = cached_sdk.chat.completions.with_raw_response.create(**ask)
    choice = raw.parse().choices[0]
    assert raw.headers.get("x-sluice-cache") == "exact" and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == original
    assert streamed() == ("exact", original)


def test_a_conversation_with_a_tool_call_and_its_answer_is_served(sdk: openai.OpenAI) -> None:
    # How the history is rendered is checked token by token in tests/serving/test_tool_calls.py; what a
    # 0.5B model makes of it is not asserted here.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    reply = sdk.chat.completions.create(model="sluice-small", messages=history, tools=[WEATHER], max_tokens=24,
                                        temperature=0, tool_choice="none")
    choice = reply.choices[0]
    assert choice.finish_reason in {"stop", "length"} and not choice.message.tool_calls  # none: never a call
    assert choice.message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 40  # the history reached the prompt


def test_a_json_schema_response_format_parses_and_validates(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = sdk.chat.completions.create(
        model="sluice-small", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Name the capital of France and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_logit_bias_bans_the_greedy_first_token(sdk: openai.OpenAI) -> None:
    plain = sdk.chat.completions.create(model="sluice-small", messages=ASK, max_tokens=1, temperature=0,
                                        logprobs=True)
    first = plain.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
    token_id = _token_id(first.bytes or [])
    banned = sdk.chat.completions.create(model="sluice-small", messages=ASK, max_tokens=1, temperature=0,
                                         logit_bias={str(token_id): -100}, presence_penalty=0.5)
    assert banned.choices[0].message.content != plain.choices[0].message.content


def _token_id(token_bytes: list[int]) -> int:
    from engines.loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("small"))
    (token_id,) = tokenizer.encode(bytes(token_bytes).decode())
    return token_id


# -- the Responses API on the real model ------------------------------------------------------------------

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


def test_a_response_with_a_forced_tool_is_a_function_call_item_valid_against_its_schema(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="sluice-small", input=ASK[0]["content"], tools=[RESPONSES_WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_a_response_with_tool_choice_auto_reads_the_models_own_call(sdk: openai.OpenAI) -> None:
    # The demo model writes its call as JSON in a code fence, not in `<tool_call>` tags (BENCHMARKS.md).
    response = sdk.responses.create(model="sluice-small", input="What's the weather in Paris?",
                                    tools=[RESPONSES_WEATHER], max_output_tokens=60, temperature=0)
    assert [(item.type, getattr(item, "name", None)) for item in response.output] == [("function_call", "get_weather")]
    assert json.loads(response.output[0].arguments)["city"] == "Paris"  # type: ignore[union-attr]


def test_a_streamed_response_with_a_json_schema_completes_and_validates(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    with sdk.responses.stream(model="sluice-small", input="Name the capital of France as JSON.", temperature=0,
                              max_output_tokens=30, text={"format": {"type": "json_schema", "name": "capital",
                                                                     "schema": schema, "strict": True}}) as stream:
        response = stream.get_final_response()
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_reasoning_effort_is_refused_by_our_engine_naming_the_responses_field(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="sluice-small", input="hi", reasoning={"effort": "low"})
    assert refused.value.param == "reasoning" and refused.value.code == "unsupported_parameter"


def test_a_cached_response_is_replayed_as_a_response_and_as_its_events(cached_sdk: openai.OpenAI) -> None:
    ask = {"model": "sluice-small", "input": "Name one primary colour.", "temperature": 0, "max_output_tokens": 12}
    first = cached_sdk.responses.with_raw_response.create(**ask)
    assert first.headers.get("x-sluice-cache") == "miss"
    time.sleep(0.5)  # kept in the background after the answer
    again = cached_sdk.responses.with_raw_response.create(**ask)
    assert again.headers.get("x-sluice-cache") == "exact"
    assert again.parse().output_text == first.parse().output_text and again.parse().id != first.parse().id
    with cached_sdk.responses.stream(**ask) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.parse().output_text
    assert events[-1].type in {"response.completed", "response.incomplete"}
