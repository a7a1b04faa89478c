from __future__ import annotations

from dataclasses import dataclass, field


class EngineOverloaded(Exception):
    """The engine's queue is full: a request is refused now rather than queued without bound."""


class EngineStepFailed(RuntimeError):
    """The engine's step raised: every request in flight fails with this (the details are logged)."""


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, from the unmodified distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step produced for one request: a delta, not the whole text so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental detokenised text; text that may still become a stop string is held back
    logprobs: list[TokenLogprob]  # one per new token when requested, else empty
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # generated so far, this delta included
    # The first delta of a request that asked for them (`SamplingParams.prompt_logprobs`): one per prompt token,
    # the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
