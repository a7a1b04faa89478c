"""Kept answers: a stream assembled into the JSON answer it amounts to, and a JSON answer replayed as a stream."""

from __future__ import annotations

import json

import msgspec

from engines.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    Usage,
    joined_tool_calls,
)
from gateway.cache.replay import as_new_response, assemble, replay

USAGE = Usage.of(12, 9)


def chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="c1", created=1, model="small",
                               choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish)])


def fragment(index: int, arguments: str, name: str | None = None, call_id: str | None = None) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call_id, type="function" if call_id else None,
                         function=DeltaFunctionCall(name=name, arguments=arguments))


# Tool calls as an OpenAI-compatible upstream streams them: a call's id, type and name first, its arguments
# in pieces, two calls interleaved by index.
UPSTREAM_TOOL_STREAM = [
    chunk(DeltaMessage(role="assistant")),
    chunk(DeltaMessage(tool_calls=[fragment(0, "", "get_weather", "call_a")])),
    chunk(DeltaMessage(tool_calls=[fragment(0, '{"city": "Pa')])),
    chunk(DeltaMessage(tool_calls=[fragment(1, '{"city": ', "get_time", "call_b")])),
    chunk(DeltaMessage(tool_calls=[fragment(0, 'ris"}'), fragment(1, '"Oslo"}')])),
    chunk(DeltaMessage(), "tool_calls"),
]


def replayed_chunks(body: bytes, include_usage: bool = False) -> list[dict]:
    events = replay(body, "chat", include_usage)
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(event[6:]) for event in events[:-1]]


def test_a_streamed_tool_call_answer_is_kept_with_its_calls():
    answer = msgspec.json.decode(assemble(UPSTREAM_TOOL_STREAM, USAGE), type=ChatCompletion)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("call_a", "function", "get_weather", {"city": "Paris"}),
        ("call_b", "function", "get_time", {"city": "Oslo"}),
    ]


def test_a_kept_tool_call_answer_replays_as_a_stream_of_the_same_calls():
    body = assemble(UPSTREAM_TOOL_STREAM, USAGE)
    chunks = replayed_chunks(body)
    deltas = [DeltaToolCall(**{**d, "function": DeltaFunctionCall(**d["function"])})
              for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert joined_tool_calls(deltas) == msgspec.json.decode(body, type=ChatCompletion).choices[0].message.tool_calls
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")] == ["tool_calls"]


def test_text_and_usage_replay_as_they_were_streamed():
    stream = [chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content="Practice ")),
              chunk(DeltaMessage(content="daily.")), chunk(DeltaMessage(), "stop")]
    body = assemble(stream, USAGE)
    answer = msgspec.json.decode(body, type=ChatCompletion)
    assert answer.choices[0].message.content == "Practice daily." and answer.choices[0].message.tool_calls is None
    chunks = replayed_chunks(body, include_usage=True)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Practice daily."
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


def test_a_stream_that_cannot_be_kept_whole_is_not_kept():
    assert assemble([], USAGE) is None
    assert assemble(UPSTREAM_TOOL_STREAM, None) is None  # no usage to account a hit by


def test_an_answer_kept_with_logprobs_replays_them_in_its_stream():
    logprobs = ChoiceLogprobs(content=[TokenLogprob(token="Hi", logprob=-0.25, bytes=[72, 105], top_logprobs=[])])
    answer = ChatCompletion(id="c1", created=1, model="small", usage=USAGE, choices=[
        ChatChoice(index=0, message=AssistantMessage(content="Hi"), finish_reason="stop", logprobs=logprobs)])
    chunks = replayed_chunks(msgspec.json.encode(answer))
    replayed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert replayed == [msgspec.to_builtins(logprobs)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi"


def test_a_hit_is_a_response_of_its_own_with_the_kept_answer():
    """New id, creation time and tool-call ids (clients key logs on them); everything else as kept, even fields
    our structs do not name."""
    kept = {"id": "chatcmpl-first", "object": "chat.completion", "created": 1, "model": "small",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": "call_first", "type": "function",
                                "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}}],
            "usage": msgspec.to_builtins(USAGE), "kv_transfer_params": {"upstream": True}}
    served = [json.loads(as_new_response(json.dumps(kept).encode(), "chat")) for _ in range(2)]
    for answer in served:
        assert answer["id"].startswith("chatcmpl-") and answer["id"] != kept["id"]
        assert answer["created"] > 1
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["id"] != "call_first"
        call["id"] = "call_first"
        assert {**answer, "id": kept["id"], "created": 1} == kept
    assert served[0]["id"] != served[1]["id"]
    completion = json.loads(as_new_response(b'{"id": "cmpl-first", "created": 1, "choices": []}', "completions"))
    assert completion["id"].startswith("cmpl-") and completion["id"] != "cmpl-first"


def test_every_replayed_chunk_names_the_backend_of_the_answer_it_replays():
    """A client pinning `seed` reads `system_fingerprint` from the chunks, as from the stream that was kept."""
    answer = ChatCompletion(id="c1", created=1, model="small", usage=USAGE, system_fingerprint="fp_abc", choices=[
        ChatChoice(index=0, message=AssistantMessage(content="Hi"), finish_reason="stop")])
    chunks = replayed_chunks(msgspec.json.encode(answer), include_usage=True)
    assert len(chunks) == 4 and {c["system_fingerprint"] for c in chunks} == {"fp_abc"}
    text = Completion(id="c2", created=1, model="small", usage=USAGE, system_fingerprint="fp_abc", choices=[
        CompletionChoice(index=0, text="Hi", finish_reason="stop")])
    events = replay(msgspec.json.encode(text), "completions", include_usage=True)
    assert {json.loads(event[6:])["system_fingerprint"] for event in events[:-1]} == {"fp_abc"}
