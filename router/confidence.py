"""The small tier's confidence in its own answer, from the log-probabilities of the tokens it chose.

`confidence(logprobs)` is the one definition the cascade, the labeller and tuning use. It is the
**mean token logprob over the first `k` answer tokens** (`CONFIDENCE_TOKENS`; the whole answer when it
is shorter), a number in (-inf, 0]: 0 means every token was the model's certain choice.

Why this candidate: on GSM8K answers of our own small tier, labelled against the reference answers
(`sluice router label`), it separated right from wrong answers best among the statistics known after the
first `k` tokens, which is what a stream needs (it must decide before it shows the client anything); one
definition serves non-streamed and streamed requests alike, so τ means the same on both. The minimum
logprob over the whole answer separated better, but only once the answer is complete. On this tier every
candidate separated weakly (a small, often truncated model); BENCHMARKS.md ("Cascade confidence") has the
AUROC of each candidate and the number of questions it rests on, and the study should be rerun on more
labels and on other tiers.

The other candidates stay here, named, so the study in `bench/router_cascade.py` can be rerun.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

CONFIDENCE_TOKENS = 32  # k: the decision window; also the streaming buffer (see gateway/routing.py)

Candidate = Callable[[Sequence[float]], float]


def mean_logprob(logprobs: Sequence[float]) -> float:
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def min_logprob(logprobs: Sequence[float]) -> float:
    return min(logprobs) if logprobs else -math.inf


def mean_first(k: int) -> Candidate:
    def candidate(logprobs: Sequence[float]) -> float:
        return mean_logprob(logprobs[:k])

    return candidate


def min_first(k: int) -> Candidate:
    def candidate(logprobs: Sequence[float]) -> float:
        return min_logprob(logprobs[:k])

    return candidate


def uncertain_fraction(threshold: float = math.log(0.5)) -> Candidate:
    """Minus the share of tokens the model chose with probability below one half."""

    def candidate(logprobs: Sequence[float]) -> float:
        if not logprobs:
            return -math.inf
        return -sum(lp < threshold for lp in logprobs) / len(logprobs)

    return candidate


def tail_mean(k: int) -> Candidate:
    """Mean over the last `k` tokens: where a GSM8K answer states its final number."""

    def candidate(logprobs: Sequence[float]) -> float:
        return mean_logprob(logprobs[-k:])

    return candidate


CANDIDATES: dict[str, Candidate] = {
    "mean": mean_logprob,
    "min": min_logprob,
    "mean_first_8": mean_first(8),
    "mean_first_16": mean_first(16),
    "mean_first_32": mean_first(32),
    "mean_first_64": mean_first(64),
    "min_first_32": min_first(32),
    "uncertain_fraction": uncertain_fraction(),
    "mean_last_16": tail_mean(16),
}


def confidence(logprobs: Sequence[float], k: int = CONFIDENCE_TOKENS) -> float:
    """The small tier's confidence: mean logprob of the first `k` answer tokens (-inf for no tokens)."""
    return mean_logprob(logprobs[:k])
