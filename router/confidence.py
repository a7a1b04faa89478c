"""The small tier's confidence in its own answer, from the log-probabilities of the tokens it chose.

Two definitions, one per path, each with its own τ (`OperatingPoint.tau`, `.tau_stream`):

- **a complete answer** (non-streamed requests): `answer_confidence`, the **minimum token logprob over the
  whole answer**. The gateway has the whole answer before it decides, and the minimum separated right from
  wrong answers best: AUROC 0.80 on 300 GSM8K answers of our small tier (61 right), against 0.73 for the
  mean and 0.67 for the mean of the first 32 tokens (BENCHMARKS.md, "Cascade confidence"). It also falls
  with length — an answer cut at its token budget has had many chances to be unsure — so τ is tuned on the
  tiers' own outcomes (`sluice router tune`), not carried across tasks of different answer lengths.
- **a stream**: `stream_confidence`, the **mean token logprob over the first `k` answer tokens**
  (`CONFIDENCE_TOKENS`; the whole answer when it is shorter): a stream must decide before it shows the client
  anything, and this was the best of the statistics known after the first `k` tokens.

Both are numbers in (-inf, 0]: 0 means every token was the model's certain choice. The other candidates stay
here, named, so the study in `bench/router_cascade.py` can be rerun.
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


def answer_confidence(logprobs: Sequence[float]) -> float:
    """A complete answer's confidence: its least likely chosen token's logprob (-inf for no tokens)."""
    return min_logprob(logprobs)


def stream_confidence(logprobs: Sequence[float], k: int = CONFIDENCE_TOKENS) -> float:
    """A stream's confidence: mean logprob of its first `k` answer tokens (-inf for no tokens)."""
    return mean_logprob(logprobs[:k])


DEFINITIONS = {  # stored with a tuned artifact: what its τs were chosen on
    "answer": "min token logprob over the whole answer",
    "stream": f"mean token logprob over the first {CONFIDENCE_TOKENS} answer tokens",
}
