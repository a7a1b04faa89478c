"""Tool calling and structured outputs on our engine: tools rendered through the chat template, the
model's `<tool_call>` blocks read back as OpenAI tool calls, forced calls and JSON schemas through
constrained decoding. The model is random, so only the grammar makes forced output well-formed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engines import structured, tool_calls
from engines.api.client import to_body
from engines.api.errors import APIError
from engines.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
)
from engines.api.rules import check_request, decode_request
from engines.sampling_params import GrammarSpec
from engines.serving import OpenAIServing
from engines.tokenizer import Tokenizer
from tests.serving.conftest import MODEL_NAME

# Qwen2.5's way of rendering tools, tool calls and tool answers, cut to its essentials.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = Tool(type="function", function=FunctionDefinition(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False},
    strict=True,
))
TIME = Tool(type="function", function=FunctionDefinition(
    name="get_time", parameters={"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                 "required": ["zone"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def tool_serving(serving: OpenAIServing) -> OpenAIServing:
    plain = serving.engine.tokenizer
    tokenizer = Tokenizer(plain.backend, TOOLS_TEMPLATE, plain.bos_token_id, plain.eos_token_ids[0])
    return OpenAIServing(serving.engine, MODEL_NAME, tokenizer=tokenizer)


def ask(**fields: object) -> ChatCompletionRequest:
    messages = [ChatMessage(role="user", content="What is the weather in Paris?")]
    return ChatCompletionRequest(model=MODEL_NAME, messages=messages, **{"temperature": 1.0, "seed": 3, **fields})


def _valid_call(call: ToolCall) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME, "get_day": DAY}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool.function.parameters)


# -- reading the model's output --------------------------------------------------------------------


def test_tool_call_blocks_become_calls_and_the_rest_stays_text() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


def test_arguments_written_as_a_json_string_are_read_as_the_object_not_encoded_twice() -> None:
    """OpenAI's wire form (`"arguments": "{...}"`), which models trained on it write: the client's
    `json.loads(arguments)` must give the object, not a string holding it."""
    quoted = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
    _, calls = tool_calls.parse(f"<tool_call>\n{quoted}\n</tool_call>")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert _named(tool_calls.whole_reply_calls(quoted, NAMES)) == [("get_weather", {"city": "Paris"})]


def test_a_block_that_is_not_a_call_stays_text() -> None:
    text = "<tool_call>\nnot json\n</tool_call>"
    assert tool_calls.parse(text) == (text, [])


def test_the_stream_parser_holds_back_a_split_marker_and_emits_whole_calls() -> None:
    parser = tool_calls.StreamParser()
    pieces = ["Sure", " <tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_",
              "call> done"]
    outputs = [parser.feed(piece) for piece in pieces]
    assert "".join(text for text, _ in outputs) + parser.flush()[0] == "Sure  done"
    assert [len(calls) for _, calls in outputs] == [0, 0, 0, 0, 1]
    assert json.loads(outputs[-1][1][0].function.arguments) == {"zone": "UTC"}


def test_text_that_only_looks_like_a_marker_start_is_released() -> None:
    parser = tool_calls.StreamParser()
    assert parser.feed("a <to") == ("a ", [])
    assert parser.feed("p>") == ("<top>", [])


def test_blank_text_around_calls_is_not_content_and_before_text_is() -> None:
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    parser = tool_calls.StreamParser()
    outputs = [parser.feed(piece) for piece in ["\n", block, "\n", block, "\n"]]
    assert [text for text, _ in outputs] == [""] * 5 and parser.flush() == ("", [])
    assert [len(calls) for _, calls in outputs] == [0, 1, 0, 1, 0]
    parser = tool_calls.StreamParser()
    assert parser.feed("\n") == ("", []) and parser.feed("Hi") == ("\nHi", [])
    parser = tool_calls.StreamParser()
    assert parser.feed(" \n") == ("", []) and parser.flush() == (" \n", [])  # no call: the reply is what it is


NAMES = frozenset({"get_weather", "get_time"})
FENCED_CALL = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


def _named(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls]


def test_a_reply_that_is_only_a_json_call_to_a_declared_tool_is_that_call() -> None:
    """What the 1.5B coder model writes instead of `<tool_call>` tags: fenced, or bare, or a list of calls."""
    assert _named(tool_calls.whole_reply_calls(FENCED_CALL, NAMES)) == [("get_weather", {"city": "Paris"})]
    assert _named(tool_calls.whole_reply_calls(' {"name": "get_time", "parameters": {"zone": "UTC"}}\n', NAMES)) == [
        ("get_time", {"zone": "UTC"})]
    both = '[{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "get_weather"}]'
    assert _named(tool_calls.whole_reply_calls(both, NAMES)) == [("get_time", {"zone": "CET"}), ("get_weather", {})]


@pytest.mark.parametrize("reply", [
    '{"name": "book_flight", "arguments": {}}',  # not one of the request's tools
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "note": "x"}',  # more than a call
    '{"name": "get_weather", "arguments": "Paris"}',  # arguments that are not an object
    FENCED_CALL + "\nThis calls the weather tool.",  # a call shown inside an answer
    '[{"name": "get_weather", "arguments": {}}, 3]',
    '{"city": "Paris"}',
    "```json\n{not json}\n```",
])
def test_json_that_is_not_only_calls_to_declared_tools_stays_text(reply: str) -> None:
    assert tool_calls.whole_reply_calls(reply, NAMES) == []
    parser = tool_calls.StreamParser(NAMES)
    streamed, calls = parser.feed(reply)
    assert streamed + parser.flush()[0] == reply and calls == [] and parser.calls == []


def test_json_whose_first_key_is_not_a_calls_streams_as_it_is_written() -> None:
    """Held only until its first key shows it cannot be a call: a JSON answer beside tools is not delayed."""
    parser = tool_calls.StreamParser(NAMES)
    assert parser.feed('{"ci') == ("", [])
    assert parser.feed('ty": "Par') == ('{"city": "Par', [])
    assert parser.feed('is"}') == ('is"}', [])
    held = tool_calls.StreamParser(NAMES)
    assert held.feed('```json\n{\n  "name": "get_we') == ("", [])  # may still be a call


def test_a_streamed_json_call_is_held_to_the_end_then_sent_as_one_call() -> None:
    parser = tool_calls.StreamParser(NAMES)
    outputs = [parser.feed(FENCED_CALL[i:i + 7]) for i in range(0, len(FENCED_CALL), 7)]
    assert all(output == ("", []) for output in outputs)
    content, calls = parser.flush()
    assert content == "" and _named(calls) == [("get_weather", {"city": "Paris"})] and parser.calls == calls


def test_prose_streams_at_once_and_json_is_not_held_without_tools() -> None:
    with_tools = tool_calls.StreamParser(NAMES)
    assert with_tools.feed("  ") == ("", [])  # blank so far: undecided
    assert with_tools.feed("It is sunny {maybe}") == ("  It is sunny {maybe}", [])
    without_tools = tool_calls.StreamParser()
    assert without_tools.feed(FENCED_CALL) == (FENCED_CALL, [])


def test_a_json_reply_that_holds_tagged_calls_still_yields_them() -> None:
    for opening in ('{"thought": 1}', '{"name": 1}'):  # released at its first key, or held to its end
        reply = opening + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
        parser = tool_calls.StreamParser(NAMES)
        streamed, calls = parser.feed(reply)
        rest, last_calls = parser.flush()
        assert streamed + rest == opening + "\n" and _named(calls + last_calls) == [("get_time", {"zone": "UTC"})]


# -- rendering --------------------------------------------------------------------------------------


def test_tools_and_a_tool_conversation_are_rendered_through_the_chat_template(tool_serving: OpenAIServing) -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
    ]
    request = ChatCompletionRequest(model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=4)
    (engine_call,) = tool_serving.prepare_chat(request)
    prompt = tool_serving.tokenizer.decode(engine_call.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt


def test_a_model_whose_template_has_no_tools_refuses_them(serving: OpenAIServing) -> None:
    with pytest.raises(APIError) as refused:
        serving.prepare_chat(ask(tools=[WEATHER]))
    assert refused.value.param == "tools" and refused.value.code == "unsupported_parameter"


def test_tool_choice_none_renders_no_tools(serving: OpenAIServing) -> None:
    serving.prepare_chat(ask(tools=[WEATHER], tool_choice="none"))  # the tool-less template is fine


# -- forced calls and schemas, generated --------------------------------------------------------------


async def test_a_named_tool_choice_forces_a_valid_call_to_that_function(tool_serving: OpenAIServing) -> None:
    choice = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    response = await tool_serving.chat(ask(tools=[WEATHER, TIME], tool_choice=choice))
    (result,) = response.choices
    assert result.finish_reason == "tool_calls" and result.message.content is None
    (call,) = result.message.tool_calls or []
    assert call.function.name == "get_weather"
    _valid_call(call)


async def test_required_streams_one_call_as_tool_call_deltas(tool_serving: OpenAIServing) -> None:
    chunks = [chunk async for chunk in tool_serving.chat_stream(ask(tools=[WEATHER, TIME], tool_choice="required"))]
    deltas = [d for chunk in chunks for c in chunk.choices for d in (c.delta.tool_calls or [])]
    finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finish == ["tool_calls"]
    (delta,) = deltas
    assert delta.index == 0 and delta.id and delta.type == "function" and delta.function is not None
    assert delta.function.name in {"get_weather", "get_time"}
    _valid_call(ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name,
                                                            arguments=delta.function.arguments or "")))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_a_streamed_calls_logprobs_come_with_the_call_not_ahead_of_it(tool_serving: OpenAIServing) -> None:
    """The call's text is held until it is whole; its tokens' logprobs are held with it, so each chunk's logprobs
    are those of what that chunk sends."""
    request = ask(tools=[WEATHER, TIME], tool_choice="required", logprobs=True, top_logprobs=2)
    chunks = [chunk async for chunk in tool_serving.chat_stream(request)]
    sent = [(bool(c.delta.tool_calls or c.delta.content), len(c.logprobs.content) if c.logprobs else 0)
            for chunk in chunks for c in chunk.choices]
    assert all(sends for sends, num_logprobs in sent if num_logprobs)  # no logprobs in a chunk that sends nothing
    assert sum(num_logprobs for _, num_logprobs in sent) == chunks[-1].usage.completion_tokens  # none lost


@pytest.mark.parametrize("seed", range(3))
async def test_a_json_schema_response_format_yields_valid_json(serving: OpenAIServing, seed: int) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "score"], "additionalProperties": False}
    response_format = ResponseFormat(type="json_schema",
                                     json_schema=JSONSchemaFormat(name="reply", schema=schema, strict=True))
    response = await serving.chat(ask(response_format=response_format, seed=seed))
    (result,) = response.choices
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.message.content or ""), schema)


async def test_a_json_schema_answer_gives_its_keys_in_the_schemas_order(serving: OpenAIServing) -> None:
    """As OpenAI's structured outputs do: a client may read the answer as it streams, in its schema's order."""
    names = ["zone", "city", "answer"]  # not sorted
    schema = {"type": "object", "properties": {name: {"enum": ["x", "y"]} for name in names},
              "required": names, "additionalProperties": False}
    response_format = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="r", schema=schema))
    response = await serving.chat(ask(response_format=response_format))
    assert list(json.loads(response.choices[0].message.content or "")) == names


def test_a_forced_call_names_its_function_before_its_arguments() -> None:
    """The model commits to a function, then writes arguments for it (in their declared order), as the chat
    template's own calls read: `{"name": ..., "arguments": {...}}`."""
    (alternative,) = [json.loads(tool_calls.forced_call_grammar([WEATHER]).source or "")]
    assert list(alternative["properties"]) == ["name", "arguments"]
    assert list(alternative["properties"]["arguments"]["properties"]) == ["city", "unit"]


# -- tools beside a response format ---------------------------------------------------------------------

FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "sunny": {"type": "boolean"}},
            "required": ["city", "sunny"], "additionalProperties": False}
FORECAST_FORMAT = ResponseFormat(type="json_schema",
                                 json_schema=JSONSchemaFormat(name="forecast", schema=FORECAST, strict=True))
DAY = Tool(type="function", function=FunctionDefinition(
    name="get_day", parameters={"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                "required": ["zone"], "additionalProperties": False}))
SHORT_TOOLS = [TIME, DAY]  # short calls: a random model's replies fit the tiny engine's context
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def _follows_grammar(serving: OpenAIServing, grammar: GrammarSpec, text: str) -> bool:
    """Whether the whole of `text` is a reply the grammar allows: each token, then the end (in the mask the
    sampler applies)."""
    engine = serving.engine.engine
    state = engine.grammars.matcher(grammar)
    if not all(state.accept(token) for token in serving.tokenizer.encode(text)):
        return False
    mask = structured.allocate_bitmask(1, engine.grammars.vocab_size)
    state.fill(mask, 0)
    return any(structured.allows(mask, 0, token) for token in engine.scheduler.eos_token_ids)


@pytest.mark.parametrize(("reply", "allowed"), [
    (f"<tool_call>\n{TIME_CALL}\n</tool_call>", True),  # the template's block
    (f"<tool_call>\n{TIME_CALL}\n</tool_call>\n<tool_call>\n{TIME_CALL}\n</tool_call>", True),
    (TIME_CALL, True),  # bare JSON, as the small demo model calls
    ('```json\n{\n  "name": "get_day",\n  "arguments": {\n    "zone": "CET"\n  }\n}\n```', True),  # the large one
    ('{"city":"Oslo","sunny":true}', True),  # the answer, compact like any structured output
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),  # invented: answered again (below)
    ('{"name": "get_weather", "arguments": "Oslo"}', False),  # an invented call's arguments are an object too
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', False),  # blocks: declared
    ('{"name": "get_time", "arguments": {"zone": "PST"}}', False),  # arguments outside the parameters
    ('{"city":"Reykjavik","sunny":true}', False),  # an answer outside the format (maxLength)
    ('{"city": "Oslo", "sunny": true}', False),  # the answer's JSON is compact
    ("It is sunny in Oslo.", False),
    ('{"name": ' + " " * 40 + '"get_time", "arguments": {"zone": "UTC"}}', False),  # bounded blanks in a call
])
def test_beside_a_response_format_a_reply_is_calls_to_the_tools_or_an_answer_in_the_format(
        tool_serving: OpenAIServing, reply: str, allowed: bool) -> None:
    grammar = tool_calls.calls_or_answer_grammar(SHORT_TOOLS, FORECAST, parallel=True)
    assert _follows_grammar(tool_serving, grammar, reply) is allowed


@pytest.mark.parametrize(("reply", "allowed"), [
    (f"<tool_call>\n{TIME_CALL}\n</tool_call>", True),
    (TIME_CALL, True),
    ('```json\n{\n  "name": "get_day",\n  "arguments": {\n    "zone": "CET"\n  }\n}\n```', True),
    ("It is sunny in Oslo.", True),  # an answer in words
    ("Oslo: {sunny} [today] <b>", True),  # what opens a call is anywhere but first
    ("", True),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),  # invented: text, as without strict tools
    ('{"name": "get_time", "arguments": {"zone": "PST"}}', False),  # arguments outside the parameters
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>', False),
    (f"Let me look.\n<tool_call>\n{TIME_CALL}\n</tool_call>", False),  # text holds no block: calls come first
    ('{"zone": "UTC"}', False),  # JSON that is no call
    (" It is sunny.", False),  # an answer starts with what it says
])
def test_beside_strict_tools_a_reply_is_valid_calls_or_text_that_holds_none(
        tool_serving: OpenAIServing, reply: str, allowed: bool) -> None:
    """Strict function schemas promise arguments that validate, whatever `tool_choice`: with "auto" the reply
    is calls with valid arguments, or text that cannot be read as a call."""
    grammar = tool_calls.calls_or_answer_grammar(SHORT_TOOLS, None, parallel=True)
    assert _follows_grammar(tool_serving, grammar, reply) is allowed


def test_without_parallel_calls_the_grammar_allows_one_block(tool_serving: OpenAIServing) -> None:
    grammar = tool_calls.calls_or_answer_grammar(SHORT_TOOLS, FORECAST, parallel=False)
    block = f"<tool_call>\n{TIME_CALL}\n</tool_call>"
    assert _follows_grammar(tool_serving, grammar, block)
    assert not _follows_grammar(tool_serving, grammar, f"{block}\n{block}")


def _banning_openings(serving: OpenAIServing, *prefixes: bytes) -> dict[int, float]:
    """A `logit_bias` that bans every token whose text opens with one of `prefixes`, wherever the grammar
    allows another token (where it allows only banned ones, they are still taken: the mask comes first).
    Blanks are banned so that the random model's calls fit the tiny engine's context."""
    prefixes = (*prefixes, b" ", b"\n")
    tokenizer = serving.tokenizer
    banned = {i: -100.0 for i in range(tokenizer.vocab_size)
              if not tokenizer.is_special(i) and tokenizer.token_bytes(i).startswith(prefixes)}
    assert 0 < len(banned) <= 300
    return banned


def _calls_or_answer(result: ChatChoice) -> str:
    """Asserts the reply is valid tool calls and nothing else, or an answer valid against FORECAST; says which
    ("cut" for a reply `max_tokens` cut short: it is cut, as any structured output)."""
    if result.finish_reason == "length":
        return "cut"
    if result.message.tool_calls:
        assert result.finish_reason == "tool_calls" and result.message.content is None
        for call in result.message.tool_calls:
            _valid_call(call)
        return "calls"
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.message.content or ""), FORECAST)
    return "answer"


async def test_tools_beside_a_response_format_give_valid_calls_or_a_valid_answer(tool_serving: OpenAIServing) -> None:
    """As on OpenAI (and the Agents SDK's agents with tools and an output type): the model calls tools or
    answers in the format, and whichever it does is valid. (A random model sometimes invents a long function
    name and runs out of the tiny engine's context: a reply cut by `max_tokens` is cut, as any structured
    output.)"""
    outcomes = []
    for seed in range(8):
        request = ask(tools=SHORT_TOOLS, response_format=FORECAST_FORMAT, seed=seed,
                      logit_bias=_banning_openings(tool_serving))
        (result,) = (await tool_serving.chat(request)).choices
        outcomes.append(_calls_or_answer(result))
    assert outcomes.count("cut") <= 4 and {"calls", "answer"} <= set(outcomes)


@pytest.mark.parametrize("parallel_tool_calls", [True, False])
async def test_calls_in_the_templates_blocks_become_tool_calls(tool_serving: OpenAIServing,
                                                               parallel_tool_calls: bool) -> None:
    """Steered to the blocks (bare and fenced JSON banned), the random model's reply is one or more calls."""
    bias = _banning_openings(tool_serving, b"{", b"`")
    for seed in range(3):
        request = ask(tools=SHORT_TOOLS, response_format=FORECAST_FORMAT, seed=seed, logit_bias=bias,
                      parallel_tool_calls=parallel_tool_calls)
        (result,) = (await tool_serving.chat(request)).choices
        assert _calls_or_answer(result) == "calls"
        assert parallel_tool_calls or len(result.message.tool_calls or []) == 1


async def test_a_streamed_answer_beside_tools_streams_as_it_is_written(tool_serving: OpenAIServing) -> None:
    """Steered to the answer (no blocks, no fences, and a first key that is not a call's `name`), the reply
    streams in pieces: it is held only until its first key shows it is not a call."""
    bias = _banning_openings(tool_serving, b"<", b"`", b"n")
    request = ask(tools=SHORT_TOOLS, response_format=FORECAST_FORMAT, stream=True, logit_bias=bias)
    chunks = [chunk async for chunk in tool_serving.chat_stream(request)]
    pieces = [c.delta.content for chunk in chunks for c in chunk.choices if c.delta.content]
    assert len(pieces) > 1 and not any(c.delta.tool_calls for chunk in chunks for c in chunk.choices)
    jsonschema.validate(json.loads("".join(pieces)), FORECAST)


def _strict(tools: list[Tool]) -> list[Tool]:
    return [Tool(type=t.type, function=FunctionDefinition(name=t.function.name, parameters=t.function.parameters,
                                                          strict=True)) for t in tools]


@pytest.mark.parametrize("stream", [False, True])
async def test_strict_tools_with_auto_choice_get_calls_whose_arguments_validate(tool_serving: OpenAIServing,
                                                                                stream: bool) -> None:
    """Steered to open with `<` (which no answer in words does), the random model calls in the template's block:
    with strict schemas its arguments validate (unconstrained, it writes `<` after `<`, a reply of no call)."""
    bias = _banning_openings(tool_serving, b"{", b"`")
    bias.update({i: 100.0 for i in range(tool_serving.tokenizer.vocab_size)
                 if not tool_serving.tokenizer.is_special(i) and tool_serving.tokenizer.token_bytes(i) == b"<"})
    for seed in range(3):
        request = ask(tools=_strict(SHORT_TOOLS), seed=seed, logit_bias=bias, stream=stream, parallel_tool_calls=False)
        if stream:
            chunks = [chunk async for chunk in tool_serving.chat_stream(request)]
            deltas = [d for chunk in chunks for c in chunk.choices for d in (c.delta.tool_calls or [])]
            finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
            (delta,) = deltas  # a call is sent whole, once it is
            assert finish == ["tool_calls"] and delta.function is not None and delta.function.name is not None
            _valid_call(ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name,
                                                                    arguments=delta.function.arguments or "")))
        else:
            (result,) = (await tool_serving.chat(request)).choices
            assert _calls_or_answer(result) == "calls"  # valid calls, no content


def _invented_call_then_answer(serving: OpenAIServing) -> dict[int, float]:
    """Steers the random model into a call to a function it invents (bare JSON, first key `name`, a name not
    opening like `get_`), closed soon (`"` and `}` favoured), then into a short answer."""
    bias = _banning_openings(serving, b"<", b"`", b"c", b"g")
    for text in ('"', "}"):
        (token,) = serving.tokenizer.encode(text)
        bias[token] = 100.0
    return bias


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_to_an_invented_function_is_answered_again_in_the_format(tool_serving: OpenAIServing,
                                                                              stream: bool) -> None:
    """Weak models answer beside tools by calling a function nobody declared; forcing a declared name would make
    it a call to the wrong tool. The reply is generated again under the format alone: a valid answer, nothing
    of the first reply sent, both generations' tokens counted."""
    request = ask(tools=SHORT_TOOLS, response_format=FORECAST_FORMAT, logit_bias=_invented_call_then_answer(
        tool_serving), stream=stream, stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = [chunk async for chunk in tool_serving.chat_stream(request)]
        choices = [c for chunk in chunks for c in chunk.choices]
        content = "".join(c.delta.content or "" for c in choices)
        assert not any(c.delta.tool_calls for c in choices) and [c.finish_reason for c in choices][-1] == "stop"
        assert [c.delta.role for c in choices if c.delta.role] == ["assistant"]
        usage = chunks[-1].usage
    else:
        response = await tool_serving.chat(request)
        (result,) = response.choices
        assert result.finish_reason == "stop" and not result.message.tool_calls
        content, usage = result.message.content or "", response.usage
    jsonschema.validate(json.loads(content), FORECAST)
    assert usage is not None and usage.completion_tokens > len(tool_serving.tokenizer.encode(content)) + 8


def test_an_invented_call_is_one_to_a_function_not_declared() -> None:
    assert tool_calls.invented_call('{"name": "say_hello", "arguments": {}}', NAMES)
    assert tool_calls.invented_call('```json\n{"name": "greet", "arguments": {"to": "Ann"}}\n```', NAMES)
    assert not tool_calls.invented_call('{"name": "get_time", "arguments": {}}', NAMES)
    assert not tool_calls.invented_call('{"name": "greet", "arguments": {}, "note": 1}', NAMES)
    assert not tool_calls.invented_call('{"city": "Oslo"}', NAMES)


async def test_a_forced_call_beside_a_response_format_is_the_call(tool_serving: OpenAIServing) -> None:
    """The format shapes a later turn's answer; this turn's reply is the forced call."""
    (result,) = (await tool_serving.chat(ask(tools=[WEATHER], tool_choice="required",
                                             response_format=FORECAST_FORMAT))).choices
    assert result.finish_reason == "tool_calls"
    _valid_call(*(result.message.tool_calls or []))


def test_an_unusable_tool_schema_beside_a_response_format_is_a_400_naming_tools(tool_serving: OpenAIServing) -> None:
    broken = Tool(type="function", function=FunctionDefinition(name="broken", parameters={"type": "nonsense"}))
    with pytest.raises(APIError) as refused:
        tool_serving.prepare_chat(ask(tools=[broken], response_format=FORECAST_FORMAT))
    assert refused.value.param == "tools" and refused.value.code == "invalid_schema"


def test_an_unusable_schema_is_a_400_naming_response_format(serving: OpenAIServing) -> None:
    bad = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="x", schema={"type": "nonsense"}))
    with pytest.raises(APIError) as refused:
        serving.prepare_chat(ask(response_format=bad))
    assert refused.value.param == "response_format" and refused.value.code == "invalid_schema"


def test_a_tool_choice_naming_an_unknown_function_is_a_400(tool_serving: OpenAIServing) -> None:
    choice = NamedToolChoice(type="function", function=NamedFunction(name="nope"))
    with pytest.raises(APIError) as refused:
        check_request(ask(tools=[WEATHER], tool_choice=choice))
    assert refused.value.param == "tool_choice"


# -- tool turns in the history ---------------------------------------------------------------------

CALL_1 = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
CALL_2 = ToolCall(id="call_2", function=FunctionCall(name="get_time", arguments='{"zone": "CET"}'))


def history(*messages: ChatMessage) -> ChatCompletionRequest:
    return conversation(ChatMessage(role="user", content="Weather and time in Paris?"), *messages)


def conversation(*messages: ChatMessage) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL_NAME, messages=list(messages), tools=[WEATHER, TIME])


def refusal(request: ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as refused:
        check_request(request)
    assert refused.value.status_code == 400
    return refused.value


def test_each_call_of_an_assistant_turn_answered_by_id_in_any_order_is_a_valid_history() -> None:
    check_request(history(
        ChatMessage(role="assistant", content=None, tool_calls=[CALL_1, CALL_2]),
        ChatMessage(role="tool", content="13:05", tool_call_id="call_2"),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
        ChatMessage(role="assistant", content="21 degrees at 13:05."),
        ChatMessage(role="user", content="Thanks!"),
    ))


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        # A tool message without the id of the call it answers.
        ([ChatMessage(role="assistant", content=None, tool_calls=[CALL_1]), ChatMessage(role="tool", content="21")],
         "messages[2].tool_call_id", "missing_required_parameter"),
        # A tool message with no call before it.
        ([ChatMessage(role="tool", content="21", tool_call_id="call_1")], "messages[1].tool_call_id", "invalid_value"),
        # An id that the assistant turn before it did not call.
        ([ChatMessage(role="assistant", content=None, tool_calls=[CALL_1]),
          ChatMessage(role="tool", content="21", tool_call_id="call_9")], "messages[2].tool_call_id", "invalid_value"),
        # One call answered twice.
        ([ChatMessage(role="assistant", content=None, tool_calls=[CALL_1]),
          ChatMessage(role="tool", content="21", tool_call_id="call_1"),
          ChatMessage(role="tool", content="22", tool_call_id="call_1")], "messages[3].tool_call_id", "invalid_value"),
        # The conversation goes on before every call is answered.
        ([ChatMessage(role="assistant", content=None, tool_calls=[CALL_1, CALL_2]),
          ChatMessage(role="tool", content="21", tool_call_id="call_1"),
          ChatMessage(role="user", content="And?")], "messages[3]", "invalid_value"),
        # The history ends on calls nobody answered.
        ([ChatMessage(role="assistant", content=None, tool_calls=[CALL_1])], "messages[1].tool_calls",
         "invalid_value"),
        # Content left out where no tool call stands in for it.
        ([ChatMessage(role="assistant", content=None)], "messages[1].content", "missing_required_parameter"),
        # Only assistant turns call tools.
        ([ChatMessage(role="user", content="hi", tool_calls=[CALL_1])], "messages[1].tool_calls", "invalid_value"),
    ],
)
def test_a_history_whose_tool_turns_do_not_pair_up_is_a_400_naming_the_message(
        messages: list[ChatMessage], param: str, code: str) -> None:
    error = refusal(history(*messages))
    assert (error.param, error.code) == (param, code)


def test_a_user_message_without_content_is_a_400() -> None:
    error = refusal(conversation(ChatMessage(role="user")))
    assert (error.param, error.code) == ("messages[0].content", "missing_required_parameter")


# -- vLLM's structured_outputs ------------------------------------------------------------------------------

CHOICES = ['say "hi"', "back\\slash", "é ü", "two\nlines"]  # quotes, backslashes, non-ASCII, a newline


@pytest.mark.parametrize("seed", range(3))
async def test_vllms_structured_outputs_constrain_the_answer_to_a_choice_a_pattern_or_a_schema(
        serving: OpenAIServing, seed: int) -> None:
    """What vLLM clients send in `extra_body`: the random model's answer holds to each form whole."""
    chosen = await serving.chat(ask(structured_outputs=StructuredOutputs(choice=CHOICES), seed=seed, max_tokens=40))
    assert chosen.choices[0].message.content in CHOICES and chosen.choices[0].finish_reason == "stop"
    regex = "[0-9]{3}-[a-z]{2,4}"
    pattern = await serving.chat(ask(structured_outputs=StructuredOutputs(regex=regex), seed=seed, max_tokens=40))
    assert re.fullmatch(regex, pattern.choices[0].message.content or "")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for form in (schema, json.dumps(schema)):  # an object, or its text
        answer = await serving.chat(ask(structured_outputs=StructuredOutputs(json=form), seed=seed, max_tokens=40))
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)
    grammar = await serving.chat(ask(structured_outputs=StructuredOutputs(grammar='start: "yes" | "no"'), seed=seed))
    assert grammar.choices[0].message.content in ("yes", "no")


async def test_structured_outputs_hold_on_the_completions_endpoint_too(serving: OpenAIServing) -> None:
    request = CompletionRequest(model=MODEL_NAME, prompt="Pick:", max_tokens=20, seed=1,
                                structured_outputs=StructuredOutputs(choice=["red", "green"]))
    assert (await serving.complete(request)).choices[0].text in ("red", "green")


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),  # two kinds
    ({"structured_outputs": {}}, "structured_outputs"),  # none
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "guided": 1}}, "structured_outputs"),  # unknown to vLLM too
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice[1]"),
])
def test_unusable_structured_outputs_are_400s_naming_the_field(
        serving: OpenAIServing, fields: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], **fields}
    with pytest.raises(APIError) as raised:
        request = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
        check_request(request)
        serving.prepare_chat(request)
    assert (raised.value.status_code, raised.value.detail.param) == (400, param)


def test_structured_outputs_reach_an_http_tier_as_sent() -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}}
    request = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert json.loads(to_body(request))["structured_outputs"] == body["structured_outputs"]
