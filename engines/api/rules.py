"""The request rules of the API, each stated once and checked at the contract's edge.

`check_request` holds every rule that the request alone decides (non-empty messages, roles and
content types, `n`, `max_tokens`, sampling ranges, stop strings, logprobs): the gateway runs it once
per request before anything is spent, and the engine server once per request it receives. Rules
that need the tier (context length, token-id range) are `max_tokens_for` and `check_token_ids`, run
by the tier that knows its model. `decoding` reads the decoding fields of a checked request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import msgspec

from engines.api.errors import APIError, invalid, validation_error
from engines.api.fields import check_refused, keep_extra_fields
from engines.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, Request, stop_list

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)

MAX_N = 16
# OpenAI takes 4 stop sequences, vLLM any number; code editors' fill-in-the-middle templates send 9 or more (one per
# special token of the model's, e.g. Continue's for Qwen2.5-Coder). Bounded: each is matched at every token.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256
MAX_REPETITION_PENALTY = 10.0  # vLLM sets no bound; past a few it only garbles the answer
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5  # OpenAI's limit for the legacy completions endpoint
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_PENALTY = 2.0  # OpenAI: presence_penalty and frequency_penalty in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI: each logit_bias value in [-100, 100]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOOLS = 128  # OpenAI's limit
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Parse a request body, turning malformed JSON and mistyped fields into a 400 naming the field; fields
    no OpenAI type names are kept as the request's `extra_fields`."""
    try:
        request = msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc
    keep_extra_fields(request, body)
    return request


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    priority: Literal["interactive", "batch"] = "interactive"
    min_p: float | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: int = 0
    # The completions endpoint's `echo` with `logprobs`: the echoed prompt's logprobs, with this many alternatives.
    prompt_logprobs: int | None = None
    # `echo` with `max_tokens: 0`: the prompt back (scored, with `logprobs`) and nothing generated, as OpenAI's
    # legacy scoring calls and vLLM take it.
    echo_only: bool = False


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    return {int(token): value for token, value in bias.items()} if bias else {}


def decoding(request: Request) -> Decoding:
    """The decoding fields of a request (read, not checked: `check_request` checks them)."""
    if isinstance(request, ChatCompletionRequest):
        limit = request.output_limit()
        limit_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        logprobs, top_logprobs = request.logprobs, request.top_logprobs or 0
    else:  # the completions endpoint's `logprobs` is the number of alternatives
        limit, limit_param = request.max_tokens, "max_tokens"
        logprobs, top_logprobs = request.logprobs is not None, request.logprobs or 0
    return Decoding(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        n=request.n,
        stop=[s for s in stop_list(request.stop) if s],
        seed=request.seed,
        output_limit=limit,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        output_limit_param=limit_param,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias),
        priority=request.priority or "interactive",
        min_p=request.min_p,
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=bool(request.ignore_eos),
        repetition_penalty=request.repetition_penalty,
        min_tokens=request.min_tokens or 0,
        prompt_logprobs=request.logprobs if isinstance(request, CompletionRequest) and request.echo else None,
        echo_only=isinstance(request, CompletionRequest) and request.echo and request.max_tokens == 0,
    )


# ---------------------------------------------------------------------------------------------
# Rules the request alone decides
# ---------------------------------------------------------------------------------------------


def check_request(request: Request) -> None:
    """Every rule the request alone decides; raises `APIError` (400) naming the offending field."""
    if request.stream_options is not None and not request.stream:
        raise invalid("`stream_options` is only allowed when `stream` is true", "stream_options")
    check_refused(request)
    check_penalties(request)
    if isinstance(request, ChatCompletionRequest):
        check_messages(request.messages)
        check_chat_fields(request)
    else:
        check_completion_fields(request)
    check_decoding(decoding(request))


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """At least one message; known roles; text content, present unless an assistant turn calls tools; tool
    turns that answer the calls before them (`check_tool_turns`)."""
    if not messages:
        raise invalid("`messages` must contain at least one message", "messages", "empty_array")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role: unsupported role {message.role!r}; expected one of {sorted(CHAT_ROLES)}",
                f"messages[{i}].role",
            )
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise invalid(f"messages[{i}].content is required: only an assistant message that calls tools may "
                          "omit it", f"messages[{i}].content", "missing_required_parameter")
        if message.tool_calls and message.role != "assistant":
            raise invalid(f"messages[{i}]: only assistant messages carry `tool_calls`; this one is "
                          f"{message.role!r}", f"messages[{i}].tool_calls")
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                raise invalid(
                    f"messages[{i}].content[{j}]: content of type {part.type!r} is not supported; "
                    "this model reads text only",
                    f"messages[{i}].content[{j}].type",
                )
    check_tool_turns(messages)


def check_tool_turns(messages: Sequence[ChatMessage]) -> None:
    """OpenAI's rule for tool turns: an assistant message with `tool_calls` is followed by one tool message per
    call, each naming its call's id in `tool_call_id`, before the conversation goes on; a tool message answers
    nothing else. Without it a template renders a result with no call, or a call with no result."""
    unanswered: list[str] = []  # ids of the last assistant turn's calls that no tool message has answered yet
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id is None:
                raise invalid(f"messages[{i}].tool_call_id is required in a tool message",
                              f"messages[{i}].tool_call_id", "missing_required_parameter")
            if message.tool_call_id not in unanswered:
                raise invalid(f"messages[{i}]: a tool message must answer a call of the assistant message before "
                              f"it; no unanswered call has the id {message.tool_call_id!r}",
                              f"messages[{i}].tool_call_id")
            unanswered.remove(message.tool_call_id)
            continue
        if unanswered:
            raise invalid(f"messages[{i}]: the assistant message with `tool_calls` before it must be followed by a "
                          f"tool message for each call; no answer to {unanswered}", f"messages[{i}]")
        unanswered = [call.id for call in message.tool_calls or ()] if message.role == "assistant" else []
    if unanswered:
        raise invalid(f"the last assistant message's `tool_calls` must each be answered by a tool message; no "
                      f"answer to {unanswered}", f"messages[{len(messages) - 1}].tool_calls")


def check_penalties(request: Request) -> None:
    """OpenAI's ranges: penalties in [-2, 2]; logit_bias maps at most 300 token ids to [-100, 100]."""
    check_range(request.presence_penalty, -MAX_PENALTY, MAX_PENALTY, "presence_penalty")
    check_range(request.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, "frequency_penalty")
    bias = request.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"`logit_bias` takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens; got {len(bias)}", "logit_bias")
    for token, value in bias.items():
        if not token.isdigit():
            raise invalid(f"`logit_bias` keys must be token ids; got {token!r}", "logit_bias")
        check_range(value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, f"logit_bias.{token}")


def check_response_format(request: ChatCompletionRequest) -> None:
    response_format = request.response_format
    if response_format is None:
        return
    if response_format.type not in RESPONSE_FORMATS:
        raise invalid(f"`response_format.type` must be one of {list(RESPONSE_FORMATS)}; got "
                      f"{response_format.type!r}", "response_format.type")
    if response_format.type == "json_schema" and response_format.json_schema is None:
        raise invalid("`response_format.json_schema` is required when the type is json_schema",
                      "response_format.json_schema", "missing_required_parameter")


def check_tools(request: ChatCompletionRequest) -> None:
    """Function tools with valid, distinct names; a tool_choice that names one of them."""
    tools = request.tools or []
    if len(tools) > MAX_TOOLS:
        raise invalid(f"`tools` takes at most {MAX_TOOLS} tools; got {len(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise invalid(f"tools[{i}].type must be 'function'; got {tool.type!r}", f"tools[{i}].type")
        if not _FUNCTION_NAME.match(tool.function.name) or tool.function.name in names:
            raise invalid(f"tools[{i}].function.name must be distinct, 1-64 of a-z, A-Z, 0-9, _ and -; got "
                          f"{tool.function.name!r}", f"tools[{i}].function.name")
        names.add(tool.function.name)
    choice = request.tool_choice
    if choice is None or choice == "none":
        return
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise invalid(f"`tool_choice` must be one of {list(TOOL_CHOICES)} or a named function; got {choice!r}",
                      "tool_choice")
    if not tools:
        raise invalid("`tool_choice` needs `tools`", "tool_choice")
    if not isinstance(choice, str) and (choice.type != "function" or choice.function.name not in names):
        raise invalid(f"`tool_choice` names {choice.function.name!r}, which is not in `tools`", "tool_choice")


def check_chat_fields(request: ChatCompletionRequest) -> None:
    check_response_format(request)
    check_tools(request)
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise invalid("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        check_range(request.top_logprobs, 0, MAX_TOP_LOGPROBS_CHAT, "top_logprobs")


def check_completion_fields(request: CompletionRequest) -> None:
    if request.suffix and request.echo:  # which text would the answer echo: the prompt, or prompt, gap and suffix?
        raise invalid("`echo` together with `suffix` is not supported", "suffix", "unsupported_parameter")
    if request.logprobs is not None:
        check_range(request.logprobs, 0, MAX_LOGPROBS_COMPLETION, "logprobs")
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


def decodes_greedily(temperature: float | None, top_p: float | None) -> bool:
    """The most likely token every step: temperature 0, or top_p 0 (which keeps that token alone, as OpenAI takes
    it). The engines decode such requests greedily; the response cache may keep their answers."""
    return temperature == 0 or top_p == 0


def check_range(value: float | None, low: float, high: float, param: str) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(f"`{param}` must be in [{low}, {high}]; got {value}", param)


def check_decoding(d: Decoding) -> None:
    check_range(d.temperature, 0.0, 2.0, "temperature")
    check_range(d.top_p, 0.0, 1.0, "top_p")  # as OpenAI: 0 keeps the most likely token alone
    check_range(d.min_p, 0.0, 1.0, "min_p")
    if d.repetition_penalty is not None and not 0.0 < d.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise invalid(f"`repetition_penalty` must be in (0, {MAX_REPETITION_PENALTY}]; got {d.repetition_penalty}",
                      "repetition_penalty")
    if len(d.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in d.stop_token_ids):
        raise invalid(f"`stop_token_ids` takes at most {MAX_STOP_TOKEN_IDS} token ids, none negative", "stop_token_ids")
    if d.top_k is not None and d.top_k < -1:
        raise invalid("`top_k` must be -1 or 0 (off) or a positive number of tokens", "top_k")
    if not 1 <= d.n <= MAX_N:
        raise invalid(f"`n` must be between 1 and {MAX_N}; got {d.n}", "n")
    if d.seed is not None and not SEED_MIN <= d.seed <= SEED_MAX:
        raise invalid(f"`seed` must be a 64-bit integer, in [{SEED_MIN}, {SEED_MAX}]; got {d.seed}", "seed")
    if len(d.stop) > MAX_STOP_STRINGS:
        raise invalid(f"`stop` takes at most {MAX_STOP_STRINGS} sequences; got {len(d.stop)}", "stop")
    if d.output_limit is not None and d.output_limit < 1 and not d.echo_only:
        raise invalid(f"`{d.output_limit_param}` must be at least 1; got {d.output_limit}", d.output_limit_param)
    if d.min_tokens < 0 or (d.output_limit is not None and d.min_tokens > d.output_limit):
        raise invalid(f"`min_tokens` must be between 0 and `{d.output_limit_param}`; got {d.min_tokens}", "min_tokens")


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
