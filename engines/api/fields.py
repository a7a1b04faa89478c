"""What becomes of every request field: nothing a client sends is silently dropped.

Each field of OpenAI's chat and completions requests has exactly one fate, stated once in `CHAT`
and `COMPLETIONS` (a test walks the installed `openai` SDK's request types against them):

- HONOURED: modelled and implemented by every tier: our engines apply it, HTTP tiers receive it.
  Informational fields (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`) change nothing
  in the output by OpenAI's definition; honouring them is accepting and forwarding them.
- FORWARDED: sent untouched to HTTP tiers (which answer for themselves); our in-process engines
  cannot do what it asks and refuse it with 400 `unsupported_parameter`, unless its value is
  neutral (asks for nothing: `store: false`, `service_tier: "auto"`, `modalities: ["text"]`,
  `reasoning_effort: "none"`, ...).
- REFUSED: 400 `unsupported_parameter` whatever the tier, unless neutral.

Fields that no OpenAI type names (vLLM's `length_penalty`, `chat_template_kwargs`, ...) are kept aside as
the request's `extra_fields`: forwarded untouched to HTTP tiers, refused by our engines. vLLM's `top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens` and `structured_outputs`, and `priority`
(the scheduling class), are modelled extensions (honoured).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec

from engines.api.errors import invalid
from engines.api.protocol import ChatCompletionRequest, CompletionRequest


class Fate(Enum):
    HONOURED = "honoured"
    FORWARDED = "forwarded"
    REFUSED = "refused"


HONOURED, FORWARDED, REFUSED = Fate.HONOURED, Fate.FORWARDED, Fate.REFUSED

_COMMON = {
    "model": HONOURED, "n": HONOURED, "stream": HONOURED, "stream_options": HONOURED, "stop": HONOURED,
    "seed": HONOURED, "temperature": HONOURED, "top_p": HONOURED, "top_k": HONOURED, "min_p": HONOURED,
    "logprobs": HONOURED, "max_tokens": HONOURED, "user": HONOURED, "presence_penalty": HONOURED,
    "frequency_penalty": HONOURED, "logit_bias": HONOURED, "priority": HONOURED, "stop_token_ids": HONOURED,
    "ignore_eos": HONOURED, "repetition_penalty": HONOURED, "min_tokens": HONOURED, "structured_outputs": HONOURED,
}

CHAT: dict[str, Fate] = {
    **_COMMON,
    "messages": HONOURED, "max_completion_tokens": HONOURED, "top_logprobs": HONOURED,
    "response_format": HONOURED, "tools": HONOURED, "tool_choice": HONOURED, "parallel_tool_calls": HONOURED,
    "metadata": HONOURED, "safety_identifier": HONOURED, "prompt_cache_key": HONOURED,
    "store": FORWARDED, "service_tier": FORWARDED, "modalities": FORWARDED, "audio": FORWARDED,
    "prediction": FORWARDED, "reasoning_effort": FORWARDED, "verbosity": FORWARDED,
    "web_search_options": FORWARDED, "prompt_cache_retention": FORWARDED, "prompt_cache_options": FORWARDED,
    "moderation": FORWARDED,
    # The deprecated forms of tools/tool_choice: refused so that capability routing, the cache scope and
    # accounting, which read `tools`, never miss a function call.
    "functions": REFUSED, "function_call": REFUSED,
}

COMPLETIONS: dict[str, Fate] = {
    **_COMMON,
    "prompt": HONOURED, "echo": HONOURED, "suffix": HONOURED,
    "best_of": FORWARDED,
}

# Values that ask for nothing: accepted wherever the field's fate would refuse it.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "reasoning_effort": ("none",),  # what a model without reasoning does
    "verbosity": ("medium",),  # OpenAI's default
    "best_of": (1,),
}

_REFUSAL_HINTS = {
    "functions": "use `tools` instead",
    "function_call": "use `tool_choice` instead",
}


def fates(request: ChatCompletionRequest | CompletionRequest) -> dict[str, Fate]:
    return CHAT if isinstance(request, ChatCompletionRequest) else COMPLETIONS


def _is_set(name: str, value: Any) -> bool:
    return value is not None and value not in _NEUTRAL.get(name, ())


# ---------------------------------------------------------------------------------------------
# Fields no OpenAI type names
# ---------------------------------------------------------------------------------------------

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def extra_fields(request: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The fields of the request body that no OpenAI request type names, with their values as sent."""
    return request.extra_fields or {}


def keep_extra_fields(request: ChatCompletionRequest | CompletionRequest, body: bytes) -> None:
    """Remember the body's fields the struct does not model (read from the raw body: msgspec drops them
    while decoding). Only the keys are parsed unless there are such fields."""
    known = fates(request)
    try:
        fields = _KEYS.decode(body)
    except msgspec.MsgspecError:
        return  # the struct decoded from this body, so this cannot happen; nothing to keep if it does
    extras = {name: msgspec.json.decode(raw) for name, raw in fields.items() if name not in known}
    request.extra_fields = extras or None


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def check_refused(request: ChatCompletionRequest | CompletionRequest) -> None:
    """400 for a REFUSED field that asks for something (every tier)."""
    for name, fate in fates(request).items():
        if fate is REFUSED and _is_set(name, getattr(request, name)):
            hint = _REFUSAL_HINTS.get(name, "omit it")
            raise invalid(f"`{name}` is not supported by Sluice; {hint}", name, "unsupported_parameter")


def check_engine_supports(request: ChatCompletionRequest | CompletionRequest, tier: str) -> None:
    """400 for what our in-process engines cannot honour: FORWARDED fields that ask for something, and
    fields no OpenAI type names."""
    for name, fate in fates(request).items():
        if fate is FORWARDED and _is_set(name, getattr(request, name)):
            raise invalid(f"`{name}` is not supported by the {tier} tier (our engine); omit it or send a "
                          "tier that supports it", name, "unsupported_parameter")
    for name in extra_fields(request):
        raise invalid(f"unknown parameter `{name}`: the {tier} tier (our engine) does not support it",
                      name, "unsupported_parameter")


# Fields that change how an answer is delivered or attributed, never what it says.
_NOT_ANSWER_SHAPING = frozenset({"stream", "stream_options", "user", "metadata", "safety_identifier",
                                 "prompt_cache_key", "store", "service_tier", "prompt_cache_retention",
                                 "priority"})
# Dicts keep the order they came in: a JSON schema's property order is the order its answer's keys come in
# (OpenAI's structured outputs, and our grammar), so schemas that differ only in it ask for different answers.
_CANONICAL = msgspec.json.Encoder()


def canonical_request(request: ChatCompletionRequest | CompletionRequest) -> bytes:
    """The request as a cache keys on it: every field that shapes the answer (messages, sampling, tools,
    tool_choice, response_format, logit_bias, unknown fields, ...), in the request's own order; transport
    and attribution fields (stream, user, metadata, ...) left out, so they never split a cache."""
    fields = {k: v for k, v in msgspec.structs.asdict(request).items()
              if v is not None and k not in _NOT_ANSWER_SHAPING}
    return _CANONICAL.encode(fields)


# ---------------------------------------------------------------------------------------------
# Capabilities: what a tier must support to serve the request
# ---------------------------------------------------------------------------------------------


STRUCTURED = "structured"  # the response format a request with vLLM's `structured_outputs` needs and records


@dataclass(frozen=True, slots=True)
class Capabilities:
    uses_tools: bool
    response_format: str | None  # json_object | json_schema | structured; None for plain text


NO_NEEDS = Capabilities(uses_tools=False, response_format=None)


def capabilities(request: ChatCompletionRequest | CompletionRequest) -> Capabilities:
    # `structured_outputs` beside a response format names the stronger need (our engines refuse the pair; an HTTP
    # tier answers for itself); tools are a need of their own either way.
    structured = STRUCTURED if request.structured_outputs is not None else None
    if not isinstance(request, ChatCompletionRequest):
        return Capabilities(uses_tools=False, response_format=structured)
    uses_tools = bool(request.tools) and request.tool_choice != "none"
    response_format = request.response_format
    kind = response_format.type if response_format is not None and response_format.type != "text" else None
    return Capabilities(uses_tools=uses_tools, response_format=structured or kind)
