"""Budgets checked before any engine work: prompt length, output cap, and the key's limits.

Prompt tokens are counted by the target tier's own tokenizer (`count_prompt_tokens`), so the
check agrees with what the tier will bill. Nothing is truncated silently: too long a prompt is
refused naming both counts; too large a `max_tokens` is clamped and the response says so.
"""

from __future__ import annotations

import msgspec

from engines.api.client import EngineClient
from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.config import PolicyConfig
from gateway.counters import Admission, Limits

Request = ChatCompletionRequest | CompletionRequest


def count_prompt_tokens(client: EngineClient, request: Request) -> int:
    """The one way prompt tokens are counted before a request runs."""
    return client.count_prompt_tokens(request)


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
    """The request with its output limit set to at most the cap (the cap when missing), and whether
    a limit the client asked for was lowered."""
    cap = policy.max_output_tokens
    asked = request.output_limit()
    if asked is not None and asked <= cap:
        return request, False
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return msgspec.structs.replace(request, max_completion_tokens=cap), True
    return msgspec.structs.replace(request, max_tokens=cap), asked is not None


def limits_of(policy: PolicyConfig) -> Limits:
    return Limits(
        rpm=policy.rpm,
        tpm=policy.tpm,
        spend_per_day_usd=policy.spend_per_day_usd,
        spend_per_month_usd=policy.spend_per_month_usd,
    )


def refusal(admission: Admission, limits: Limits) -> APIError:
    """The 429 for a request the counters refused."""
    retry = {"Retry-After": str(admission.retry_after_s)}
    match admission.refused_by:
        case "rpm":
            message = f"Rate limit reached: {limits.rpm} requests per minute."
        case "tpm":
            message = f"Rate limit reached: {limits.tpm} tokens per minute."
        case "spend_per_day":
            message = f"Daily budget of ${limits.spend_per_day_usd} reached."
        case _:
            message = f"Monthly budget of ${limits.spend_per_month_usd} reached."
    if admission.refused_by in ("rpm", "tpm"):
        code, error_type = "rate_limit_exceeded", "rate_limit_error"
    else:
        code, error_type = "budget_exceeded", "insufficient_quota"  # OpenAI's type for an exhausted quota
    message = f"{message} Retry after {admission.retry_after_s} s."
    return APIError(429, message, code=code, type=error_type, headers=retry)
