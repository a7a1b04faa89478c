"""The request rules of the API, each stated once and checked at the contract's edge.

`check_request` holds every rule that the request alone decides (non-empty messages, roles and
content types, `n`, `max_tokens`, sampling ranges, stop strings, logprobs): the gateway runs it once
per request before anything is spent, and the engine server once per request it receives. Rules
that need the tier (context length, token-id range) are `max_tokens_for` and `check_token_ids`, run
by the tier that knows its model. `decoding` reads the decoding fields of a checked request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from engines.api.errors import APIError, invalid, validation_error
from engines.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, stop_list

Request = ChatCompletionRequest | CompletionRequest
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5  # OpenAI's limit for the legacy completions endpoint
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Parse a request body, turning malformed JSON and mistyped fields into a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc


@dataclass(frozen=True)
class Decoding:
    """The decoding fields both endpoints share, under one set of names."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    n: int
    stop: list[str]
    seed: int | None
    output_limit: int | None
    logprobs: bool
    top_logprobs: int
    output_limit_param: str


def decoding(request: Request) -> Decoding:
    """The decoding fields of a request (read, not checked: `check_request` checks them)."""
    if isinstance(request, ChatCompletionRequest):
        return Decoding(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            n=request.n,
            stop=[s for s in stop_list(request.stop) if s],
            seed=request.seed,
            output_limit=request.output_limit(),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
            output_limit_param="max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        )
    return Decoding(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        n=request.n,
        stop=[s for s in stop_list(request.stop) if s],
        seed=request.seed,
        output_limit=request.max_tokens,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        output_limit_param="max_tokens",
    )


# ---------------------------------------------------------------------------------------------
# Rules the request alone decides
# ---------------------------------------------------------------------------------------------


def check_request(request: Request) -> None:
    """Every rule the request alone decides; raises `APIError` (400) naming the offending field."""
    if request.stream_options is not None and not request.stream:
        raise invalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    if isinstance(request, ChatCompletionRequest):
        check_messages(request.messages)
        check_chat_fields(request)
    else:
        check_completion_fields(request)
    check_decoding(decoding(request))


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """At least one message; known roles; text content only."""
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages", "empty_array")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role: unsupported role {message.role!r}; expected one of {sorted(CHAT_ROLES)}",
                f"messages[{i}].role",
            )
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                raise invalid(
                    f"messages[{i}].content[{j}]: content of type {part.type!r} is not supported; "
                    "this model reads text only",
                    f"messages[{i}].content[{j}].type",
                )


def check_chat_fields(request: ChatCompletionRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise invalid(f"`{name}` is not supported by this engine; omit it or send 0", name, "unsupported_parameter")
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise invalid("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        check_range(request.top_logprobs, 0, MAX_TOP_LOGPROBS_CHAT, "top_logprobs")


def check_completion_fields(request: CompletionRequest) -> None:
    if request.logprobs is not None:
        check_range(request.logprobs, 0, MAX_LOGPROBS_COMPLETION, "logprobs")
        if request.echo:
            raise invalid(
                "`echo` together with `logprobs` (prompt logprobs) is not supported", "echo", "unsupported_parameter"
            )
    check_prompt_shape(request.prompt)


def check_prompt_shape(prompt: object) -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists; none empty."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len({type(p) for p in prompt}) > 1:
            raise invalid("`prompt` must be a string, a list of strings, or token ids", "prompt", "invalid_type")
        items = prompt
    else:
        raise invalid("`prompt` must be a string, a list of strings, or token ids", "prompt", "invalid_type")
    for i, item in enumerate(items):
        if not item:
            raise invalid(f"prompt {i} is empty", "prompt", "empty_prompt")


def check_range(value: float | None, low: float, high: float, param: str, low_open: bool = False) -> None:
    if value is None:
        return
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"`{param}` must be in {bracket}{low}, {high}]; got {value}", param)


def check_decoding(d: Decoding) -> None:
    check_range(d.temperature, 0.0, 2.0, "temperature")
    check_range(d.top_p, 0.0, 1.0, "top_p", low_open=True)
    if d.top_k is not None and d.top_k < -1:
        raise invalid("`top_k` must be -1 or 0 (off) or a positive number of tokens", "top_k")
    if not 1 <= d.n <= MAX_N:
        raise invalid(f"`n` must be between 1 and {MAX_N}; got {d.n}", "n")
    if len(d.stop) > MAX_STOP_STRINGS:
        raise invalid(f"`stop` takes at most {MAX_STOP_STRINGS} sequences; got {len(d.stop)}", "stop")
    if d.output_limit is not None and d.output_limit < 1:
        raise invalid(f"`{d.output_limit_param}` must be at least 1; got {d.output_limit}", d.output_limit_param)


# ---------------------------------------------------------------------------------------------
# Rules the tier decides (it knows its model)
# ---------------------------------------------------------------------------------------------


def max_tokens_for(d: Decoding, num_prompt_tokens: int, max_model_len: int) -> int:
    """The completion's token budget: what the client asked for, or all the room the context leaves.
    Refuses a request that does not fit the model's context."""
    remaining = max_model_len - num_prompt_tokens
    if remaining < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
            "tokens, leaving no room for a completion.",
            param="messages",
            code="context_length_exceeded",
        )
    max_tokens = d.output_limit if d.output_limit is not None else remaining
    if max_tokens > remaining:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or `{d.output_limit_param}`.",
            param=d.output_limit_param,
            code="context_length_exceeded",
        )
    return max_tokens


def check_token_ids(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    for i, prompt in enumerate(prompts):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise invalid(f"prompt {i} has token ids outside [0, {vocab_size})", "prompt")
