"""The confidence cascade, as plain logic over wire objects (no HTTP, no tier calls).

When the router sends a request to the small tier and the operating point sets τ for the request's path, the
small tier is asked for token logprobs; an answer whose confidence is below τ is abandoned and the request
escalated to the large tier, whose answer alone reaches the client. A complete answer's confidence is
`router.confidence.answer_confidence`, a stream's `stream_confidence` (each with its own τ).

A stream decides within its first `k` tokens: they are held back (`StreamProbe`) until `k` have
arrived, the small tier's stream ends, or the buffering deadline passes, whichever comes first; then
they are flushed and the stream goes on, or the stream is dropped and the large tier streams instead.
The deadline comes from the small tier's TTFT SLO: holding tokens back adds to the client's time to
first token, so it may not eat more of the SLO than the small tier itself leaves free.

The cascade asks for logprobs on the client's behalf; `strip_logprobs` removes them again when the
client did not ask, so they never leak.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from engines.api.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from router.confidence import CONFIDENCE_TOKENS, answer_confidence, stream_confidence

Request = ChatCompletionRequest | CompletionRequest
Response = ChatCompletion | Completion
Chunk = ChatCompletionChunk | Completion


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """How one small-tier request may escalate."""

    tau: float  # escalate when confidence < tau (the τ of the request's path: answer or stream)
    escalate_to: str
    k: int = CONFIDENCE_TOKENS  # streams: decide within this many tokens
    buffer_s: float = math.inf  # streams: ...or when tokens have been held back this long


def buffer_budget_s(slo_ttft_p99_ms: float, elapsed_s: float) -> float:
    """How long a stream may hold tokens back: what the small tier's TTFT SLO leaves after the time
    already spent on this request (at least zero: past the SLO, decide on the first chunk)."""
    return max(0.0, slo_ttft_p99_ms / 1000 - elapsed_s)


def should_escalate(conf: float | None, tau: float | None) -> bool:
    """Below τ escalates; no confidence (an upstream without logprobs) or no τ never does."""
    return tau is not None and conf is not None and conf < tau


def client_wants_logprobs(request: Request) -> bool:
    if isinstance(request, ChatCompletionRequest):
        return request.logprobs
    return request.logprobs is not None


def with_logprobs(request: Request) -> Request | None:
    """The request asking for the chosen tokens' logprobs, or None when it cannot (completions with `echo`: there
    logprobs score the whole prompt too, a cost the answer's confidence does not need, and mix it into the answer's)."""
    if isinstance(request, ChatCompletionRequest):
        return request if request.logprobs else msgspec.structs.replace(request, logprobs=True)
    if request.echo:
        return None
    return request if request.logprobs is not None else msgspec.structs.replace(request, logprobs=0)


def _choice_logprobs(choice: object) -> list[float] | None:
    logprobs = getattr(choice, "logprobs", None)
    if logprobs is None:
        return None
    content = getattr(logprobs, "content", None)
    if content is not None:  # chat
        return [t.logprob for t in content]
    values = getattr(logprobs, "token_logprobs", None)  # completions
    return None if values is None else [v for v in values if v is not None]


def response_confidence(response: Response) -> float | None:
    """The least confident choice's confidence (one weak choice of `n` is a weak answer), None when the
    upstream returned no logprobs."""
    values = [_choice_logprobs(c) for c in response.choices]
    if not values or any(v is None for v in values):
        return None
    return min(answer_confidence(v) for v in values)  # type: ignore[arg-type]


def strip_logprobs(obj: Response | Chunk) -> None:
    """Remove logprobs the cascade asked for and the client did not (in place)."""
    for choice in obj.choices:
        choice.logprobs = None


@dataclass(slots=True)
class StreamProbe:
    """Holds back a stream's first chunks and collects their logprobs until it can decide."""

    plan: CascadePlan
    clock: Callable[[], float] = time.perf_counter
    started: float = field(default=0.0)
    chunks: list[Chunk] = field(default_factory=list)
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # choice index → chosen tokens' logprobs
    without_logprobs: bool = False  # a content chunk came without logprobs: the upstream gives none

    def __post_init__(self) -> None:
        self.started = self.clock()

    def add(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        for choice in chunk.choices:
            values = _choice_logprobs(choice)
            if values is None:
                self.without_logprobs |= bool(_chunk_choice_text(choice))
                continue
            self.logprobs.setdefault(choice.index, []).extend(values)

    @property
    def tokens(self) -> int:
        return min((len(v) for v in self.logprobs.values()), default=0)

    def ready(self) -> bool:
        """Enough seen to decide: `k` tokens of every choice, or the buffering time is up."""
        return self.without_logprobs or self.tokens >= self.plan.k or self.clock() - self.started >= self.plan.buffer_s

    @property
    def confidence(self) -> float | None:
        if self.without_logprobs or not self.logprobs:
            return None
        return min(stream_confidence(v, self.plan.k) for v in self.logprobs.values())

    @property
    def generated_tokens(self) -> int:
        """Tokens the small tier produced so far (each chosen token carries one logprob)."""
        return sum(len(v) for v in self.logprobs.values())


def _chunk_choice_text(choice: object) -> str:
    delta = getattr(choice, "delta", None)
    if delta is not None:
        return delta.content or ""
    return getattr(choice, "text", "") or ""


def answer_texts(response: Response) -> list[str]:
    if isinstance(response, ChatCompletion):
        return [c.message.content or "" for c in response.choices]
    return [c.text for c in response.choices]


def first_answer(response: Response) -> str:
    texts = answer_texts(response)
    return texts[0] if texts else ""


def joined(chunks: Sequence[Chunk]) -> str:
    """The first choice's text over a list of chunks."""
    return "".join(_chunk_choice_text(c) for chunk in chunks for c in chunk.choices if c.index == 0)
