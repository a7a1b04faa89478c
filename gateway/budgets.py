"""Budgets checked before any engine work: prompt length, output cap, and the key's limits.

Prompt tokens are counted by the target tier's own tokenizer (`count_prompt_tokens`), so the
check agrees with what the tier will bill. Nothing is truncated silently: too long a prompt is
refused naming both counts; too large a `max_tokens` is clamped and the response says so.
Replies carry OpenAI's `x-ratelimit-*` headers for the key's per-minute limits (`rate_limit_headers`).
"""

from __future__ import annotations

import asyncio

import msgspec

from engines.api.client import EngineClient
from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, Request
from gateway.config import PolicyConfig, Settings
from gateway.cost import request_cost
from gateway.counters import Admission, Charge, Limits, MinuteLeft

# Prompts longer than this many characters are tokenised on a worker thread: the tokenizer takes about a
# microsecond a character (a megabyte: about a second), during which no other request would move.
OFFLOAD_PROMPT_CHARS = 16_384
# More characters than any one token spans in the vocabularies we know (Qwen2's longest is 128; SentencePiece
# pieces are far shorter), so a prompt of more characters than the token limit times this cannot fit it.
MAX_CHARS_PER_TOKEN = 256


def count_prompt_tokens(client: EngineClient, request: Request) -> int:
    """The one way prompt tokens are counted before a request runs."""
    return client.count_prompt_tokens(request)


async def count_prompt_tokens_off_loop(client: EngineClient, request: Request) -> int:
    """`count_prompt_tokens`, on a worker thread when the prompt is large."""
    if prompt_chars(request) <= OFFLOAD_PROMPT_CHARS:
        return count_prompt_tokens(client, request)
    return await asyncio.to_thread(count_prompt_tokens, client, request)


def prompt_chars(request: Request) -> int:
    """Characters of prompt text (token ids count one each): a cheap size, read before tokenising."""
    if isinstance(request, ChatCompletionRequest):
        total = 0
        for message in request.messages:
            content = message.content
            if isinstance(content, str):
                total += len(content)
            elif content:
                total += sum(len(part.text or "") for part in content)
        return total
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(item) if isinstance(item, str | list) else 1 for item in prompt)


def check_prompt_size(request: Request, policy: PolicyConfig) -> None:
    """Refuse, before anything tokenises it, a prompt too long in characters to fit the key's token limit.
    Tokenising costs about a microsecond a character, on the router's embedder and on the tier's tokenizer
    each (a 12 MB body under the body limit took 27 s of CPU to refuse by its token count)."""
    chars, most = prompt_chars(request), policy.max_prompt_tokens * MAX_CHARS_PER_TOKEN
    if chars > most:
        raise APIError(
            400,
            f"The prompt has {chars} characters; this key's limit of {policy.max_prompt_tokens} tokens holds at "
            f"most {most}. Shorten the prompt.",
            code="prompt_too_long",
            param="messages",
        )


def check_prompt_length(prompt_tokens: int, policy: PolicyConfig) -> None:
    if prompt_tokens > policy.max_prompt_tokens:
        raise APIError(
            400,
            f"The prompt has {prompt_tokens} tokens, more than this key's limit of {policy.max_prompt_tokens}. "
            "Shorten the prompt.",
            code="prompt_too_long",
            param="messages",
        )


def clamp_output(request: Request, policy: PolicyConfig) -> tuple[Request, bool]:
    """The request with its output limit set to at most the cap (the cap when missing; vLLM's `min_tokens` with
    it), and whether a limit the client asked for was lowered."""
    cap = policy.max_output_tokens
    asked = request.output_limit()
    if asked is not None and asked <= cap:
        return request, False
    chat_limit = isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None
    changes: dict[str, int] = {"max_completion_tokens" if chat_limit else "max_tokens": cap}
    if request.min_tokens is not None and request.min_tokens > cap:
        changes["min_tokens"] = cap  # a floor above the limit is refused by vLLM tiers
    return msgspec.structs.replace(request, **changes), asked is not None


def prompt_count(request: Request) -> int:
    """How many prompts a request carries: a completions prompt may be a list of them."""
    if isinstance(request, ChatCompletionRequest):
        return 1
    prompt = request.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(item, int) for item in prompt):
        return 1
    return len(prompt)


def worst_case_output(request: Request) -> int:
    """The most completion tokens a request (its output limit already clamped) may produce."""
    return (request.output_limit() or 0) * request.n * prompt_count(request)


def check_amplification(request: Request, policy: PolicyConfig) -> None:
    """One request may not fan out beyond the policy: prompt lists and total output are bounded."""
    prompts = prompt_count(request)
    if prompts > policy.max_prompts_per_request:
        raise APIError(
            400,
            f"The prompt list has {prompts} prompts, more than this key's limit of {policy.max_prompts_per_request}.",
            code="too_many_prompts",
            param="prompt",
        )
    output = worst_case_output(request)
    if output > policy.max_request_output_tokens:
        raise APIError(
            400,
            f"This request may produce {output} tokens (max_tokens × n × prompts), more than this key's limit of "
            f"{policy.max_request_output_tokens}. Lower `max_tokens` or `n`.",
            code="output_too_large",
            param="n",
        )


def reservation(settings: Settings, tiers: list[str], request: Request, prompt_tokens: int) -> Charge:
    """What admission counts before the request runs: its worst-case output, priced at the dearest
    tier that may serve it (fallback may move it)."""
    output = worst_case_output(request)
    cost = max(request_cost(settings.tiers[tier], prompt_tokens, output, 0) for tier in tiers)
    return Charge(completion_tokens=output, cost_usd=cost)


def limits_of(policy: PolicyConfig) -> Limits:
    return Limits(
        rpm=policy.rpm,
        tpm=policy.tpm,
        spend_per_day_usd=policy.spend_per_day_usd,
        spend_per_month_usd=policy.spend_per_month_usd,
    )


def rate_limit_headers(minute: MinuteLeft) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the limits there are: the limit, what is left of it this minute
    (tokens: the prompt and the most output each admitted request may produce), and when the minute ends,
    as a duration (`12.5s`). Clients pace themselves on them."""
    headers: dict[str, str] = {}
    reset = f"{minute.reset_s:.3f}".rstrip("0").rstrip(".") + "s"
    for kind, limit, remaining in (("requests", minute.limit_requests, minute.remaining_requests),
                                   ("tokens", minute.limit_tokens, minute.remaining_tokens)):  # fmt: skip
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


def refusal(admission: Admission, limits: Limits) -> APIError:
    """The 429 for a request the counters refused; for a per-minute limit, its rate-limit headers with none left."""
    reset_s = admission.retry_after_s
    spent = MinuteLeft(reset_s=reset_s)  # a spend budget: no per-minute headers
    match admission.refused_by:
        case "rpm":
            message = f"Rate limit reached: {limits.rpm} requests per minute."
            spent = MinuteLeft(limit_requests=limits.rpm, remaining_requests=0, reset_s=reset_s)
        case "tpm":
            message = f"Rate limit reached: {limits.tpm} tokens per minute."
            spent = MinuteLeft(limit_tokens=limits.tpm, remaining_tokens=0, reset_s=reset_s)
        case "spend_per_day":
            message = f"Daily budget of ${limits.spend_per_day_usd} reached."
        case _:
            message = f"Monthly budget of ${limits.spend_per_month_usd} reached."
    if admission.refused_by in ("rpm", "tpm"):
        code, error_type = "rate_limit_exceeded", "rate_limit_error"
    else:
        code, error_type = "budget_exceeded", "insufficient_quota"  # OpenAI's type for an exhausted quota
    message = f"{message} Retry after {reset_s} s."
    headers = {"Retry-After": str(reset_s), **rate_limit_headers(spent)}
    return APIError(429, message, code=code, type=error_type, headers=headers)
