"""Cached answers and streams: an answer kept from a stream, and a kept answer replayed as a stream.

An entry always holds the plain JSON answer (chat.completion / text_completion). A streamed miss is
kept by assembling its chunks, tool calls included; a hit is served as a response of its own (new ids, see
`as_new_response`), and a streamed hit replays it as server-sent events: the role, the text and tool calls
with their logprobs, the finish reason, the usage chunk when the client asked for it, then [DONE].
"""

from __future__ import annotations

import msgspec

from engines.api.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    DeltaMessage,
    Usage,
    joined_tool_calls,
    new_call_id,
    new_id,
    now,
    sse_event,
    tool_call_deltas,
)

Chunk = ChatCompletionChunk | Completion


def assemble(chunks: list[Chunk], usage: Usage | None) -> bytes | None:
    """The JSON answer a stream of one choice amounts to; None when it cannot be kept whole (several
    choices, logprobs, or no usage)."""
    if not chunks:
        return None
    choices = [choice for c in chunks for choice in c.choices]
    if usage is None or any(ch.index != 0 or ch.logprobs is not None for ch in choices):
        return None
    finish = next((ch.finish_reason for ch in reversed(choices) if ch.finish_reason), None)
    first = chunks[0]
    if isinstance(first, ChatCompletionChunk):
        text = "".join(ch.delta.content or "" for ch in choices)  # type: ignore[union-attr]
        calls = joined_tool_calls([call for ch in choices for call in ch.delta.tool_calls or []])  # type: ignore[union-attr]
        # With tool calls and no text besides, content is null, as in a JSON answer.
        message = AssistantMessage(content=text if text or not calls else None, tool_calls=calls or None)
        answer: ChatCompletion | Completion = ChatCompletion(
            id=first.id,
            created=first.created,
            model=first.model,
            usage=usage,
            choices=[ChatChoice(index=0, message=message, finish_reason=finish)],
            system_fingerprint=first.system_fingerprint,
        )
    else:
        text = "".join(ch.text for ch in choices)  # type: ignore[union-attr]
        answer = Completion(
            id=first.id,
            created=first.created,
            model=first.model,
            usage=usage,
            choices=[CompletionChoice(index=0, text=text, finish_reason=finish)],
            system_fingerprint=first.system_fingerprint,
        )
    return msgspec.json.encode(answer)


def as_new_response(body: bytes, endpoint: str) -> bytes:
    """A kept answer served again, as a response of its own: a new id, creation time and tool-call ids; the
    rest of the answer as it was kept, whatever fields it holds. Clients and their log pipelines key on these
    ids: a hit that reused them was dropped as a duplicate of the first answer or merged with its record, and
    two conversations could hold one tool-call id."""
    answer = msgspec.json.decode(body)
    answer["id"] = new_id("chatcmpl" if endpoint == "chat" else "cmpl")
    answer["created"] = now()
    for choice in answer.get("choices") or []:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call["id"] = new_call_id()
    return msgspec.json.encode(answer)


def replay(body: bytes, endpoint: str, include_usage: bool) -> list[bytes]:
    """The server-sent events of a kept answer."""
    if endpoint == "chat":
        chat = msgspec.json.decode(body, type=ChatCompletion)
        events = []
        for choice in chat.choices:
            message = choice.message
            events.append(_chat_chunk(chat, choice.index, DeltaMessage(role="assistant", content="")))
            answer = DeltaMessage(content=message.content or None,
                                  tool_calls=tool_call_deltas(message.tool_calls) if message.tool_calls else None)
            if answer.content or answer.tool_calls or choice.logprobs:
                events.append(_chat_chunk(chat, choice.index, answer, logprobs=choice.logprobs))
            events.append(_chat_chunk(chat, choice.index, DeltaMessage(), choice.finish_reason))
        if include_usage:
            events.append(sse_event(ChatCompletionChunk(
                id=chat.id, created=chat.created, model=chat.model, choices=[], usage=chat.usage,
                system_fingerprint=chat.system_fingerprint)))
        return [*events, SSE_DONE]
    completion = msgspec.json.decode(body, type=Completion)
    events = [sse_event(_completion_chunk(completion, [choice])) for choice in completion.choices]
    if include_usage and completion.usage is not None:
        events.append(sse_event(_completion_chunk(completion, [], completion.usage)))
    return [*events, SSE_DONE]


# Every chunk carries the answer's id, time, model and fingerprint, as the stream it was kept from did.


def _chat_chunk(chat: ChatCompletion, index: int, delta: DeltaMessage, finish: str | None = None,
                logprobs: ChoiceLogprobs | None = None) -> bytes:
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
    return sse_event(ChatCompletionChunk(id=chat.id, created=chat.created, model=chat.model, choices=[choice],
                                         system_fingerprint=chat.system_fingerprint))


def _completion_chunk(completion: Completion, choices: list[CompletionChoice],
                      usage: Usage | None = None) -> Completion:
    return Completion(id=completion.id, created=completion.created, model=completion.model, choices=choices,
                      usage=usage, system_fingerprint=completion.system_fingerprint)
