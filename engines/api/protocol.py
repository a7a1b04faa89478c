"""The OpenAI wire schema, defined once.

The engine server and the gateway both speak it, so it lives at the bottom of the dependency
chain (gateway → router → engines). Every field of OpenAI's request types is modelled here; what
becomes of each (honoured, forwarded to HTTP tiers only, or refused) is `engines.api.fields`' table.
Fields no OpenAI type names are kept in `extra_fields` by `fields.keep_extra_fields`. Response
structs serialise exactly the fields the official SDK reads.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


def wants_stream_usage(stream_options: StreamOptions | None) -> bool:
    """Did the client ask for the final usage-only chunk of a stream?"""
    return stream_options is not None and stream_options.include_usage


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedFunction


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # text | json_object | json_schema
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (its StructuredOutputsParams, vLLM 0.10.2 on): one form the answer must take.
    Every field vLLM defines, so none is dropped on the way to an HTTP tier; our engines read it in
    `engines.serving.structured_output_grammar`."""

    json: str | dict[str, Any] | None = None  # a JSON schema, or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        """The message's text, with multi-part content joined (only text parts are supported)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension, as in vLLM
    min_p: float | None = None  # extension, as in vLLM: drop tokens below min_p × the top token's probability
    stop_token_ids: list[int] | None = None  # extension, as in vLLM: these tokens end the answer (not in its text)
    ignore_eos: bool | None = None  # extension, as in vLLM: generate to the token limit (benchmark clients send it)
    repetition_penalty: float | None = None  # extension, as in vLLM: > 1 discourages tokens seen in prompt or answer
    min_tokens: int | None = None  # extension, as in vLLM: no EOS, stop token or stop string before this many tokens
    structured_outputs: StructuredOutputs | None = None  # extension, as in vLLM: the answer constrained to a form
    # Extension: the scheduling class. The gateway sets it (a key's policy, or `x-sluice-priority` where
    # the key may choose); our engines admit interactive work first and preempt batch work for it.
    priority: Literal["interactive", "batch"] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Forwarded untouched to HTTP tiers; refused by our engines unless neutral (see engines.api.fields).
    store: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    # Refused everywhere (deprecated forms of `tools` and `tool_choice`).
    functions: Any = None
    function_call: Any = None
    # Body fields no OpenAI type names, set by `fields.keep_extra_fields` (a field, so copies keep it).
    extra_fields: dict[str, Any] | None = None

    def output_limit(self) -> int | None:
        """`max_completion_tokens` supersedes the deprecated `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    # A string, strings, token ids, or lists of token ids. msgspec allows one array type per union, so the
    # element types are one union; mixed lists are refused where prompts are read (`completion_prompts`).
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None  # as in ChatCompletionRequest
    stop_token_ids: list[int] | None = None  # as in ChatCompletionRequest
    ignore_eos: bool | None = None  # as in ChatCompletionRequest
    repetition_penalty: float | None = None  # as in ChatCompletionRequest
    min_tokens: int | None = None  # as in ChatCompletionRequest
    structured_outputs: StructuredOutputs | None = None  # as in ChatCompletionRequest
    priority: Literal["interactive", "batch"] | None = None  # as in ChatCompletionRequest
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # The text after the completion: fill in the middle (`engines.api.prompts.completion_prompts`).
    suffix: str | None = None
    # Forwarded untouched to HTTP tiers; refused by our engines unless neutral (see engines.api.fields).
    best_of: Any = None
    extra_fields: dict[str, Any] | None = None  # as in ChatCompletionRequest

    def output_limit(self) -> int | None:
        return self.max_tokens


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details else 0


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


def tool_call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[DeltaToolCall]:
    """Whole calls as OpenAI-style stream deltas (id, type and name with the complete arguments)."""
    return [
        DeltaToolCall(index=first_index + i, id=call.id, type=call.type,
                      function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
        for i, call in enumerate(calls)
    ]


def joined_tool_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The calls a stream's tool-call deltas amount to, whether each call came whole or in fragments: the
    fragments of a call share its index, the first carries its id, type and name, the arguments come in pieces."""
    parts: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        part = parts.setdefault(delta.index, {"id": None, "type": None, "name": None, "arguments": []})
        part["id"] = part["id"] or delta.id
        part["type"] = part["type"] or delta.type
        if delta.function is not None:
            part["name"] = part["name"] or delta.function.name
            part["arguments"].append(delta.function.arguments or "")
    return [
        ToolCall(id=part["id"] or "", type=part["type"] or "function",
                 function=FunctionCall(name=part["name"] or "", arguments="".join(part["arguments"])))
        for _, part in sorted(parts.items())
    ]


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int = 0
    object: str = "model"
    owned_by: str = "sluice"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


# Either endpoint's request, and either endpoint's stream chunk.
Request = ChatCompletionRequest | CompletionRequest
Chunk = ChatCompletionChunk | Completion


# ---------------------------------------------------------------------------------------------
# Helpers shared by every producer of these objects
# ---------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object, as OpenAI streams them."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
