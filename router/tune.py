"""Choosing the operating point: the classifier threshold (and the cascade's τ) that cost least at a quality bar.

A request whose score is >= threshold goes to the large tier. One routed to small whose small-tier confidence is
below τ is escalated: it pays for both attempts and gets the large answer. Quality is the mean score of the answers
served; the bar is `quality_target` × the large-only quality on the same rows. Among all (threshold, τ) pairs on
the candidate grid that meet the bar, the cheapest wins (ties: fewer large calls). Without confidences τ is None.

Streams decide on another confidence (`router.confidence`): at the chosen threshold, `tau_stream` is the lowest τ
on the rows' stream confidences that still meets the bar (the fewest escalations, so the cheapest), or None where
the threshold meets it without escalating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.artifact import OperatingPoint

QUALITY_TARGETS = tuple(round(0.80 + 0.01 * i, 2) for i in range(21))  # 0.80 … 1.00, stored with each artifact
CHARS_PER_TOKEN = 4.0  # rough prompt-token estimate when a training file carries no token counts
TAU_CANDIDATES = 51  # τ candidates: quantiles of the confidences


@dataclass(frozen=True, slots=True)
class Prices:
    """Per 1M tokens, as in the tier config (`price_input_per_mtok`, `price_output_per_mtok`)."""

    small_input: float
    small_output: float
    large_input: float
    large_output: float


def request_costs(prompts: Sequence[str], prices: Prices, output_tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """USD per request on the small and on the large tier, prompt tokens estimated from length."""
    tokens_in = np.array([len(p) for p in prompts], dtype=np.float64) / CHARS_PER_TOKEN
    small = (tokens_in * prices.small_input + output_tokens * prices.small_output) / 1e6
    large = (tokens_in * prices.large_input + output_tokens * prices.large_output) / 1e6
    return small, large


def _candidates(values: np.ndarray, count: int) -> np.ndarray:
    """Thresholds at up to `count` quantiles of `values`, plus one above all (nothing passes)."""
    qs = np.unique(np.quantile(values, np.linspace(0.0, 1.0, count)))
    return np.append(qs, np.inf)


def outcome(
    scores: np.ndarray, threshold: float, tau: float | None, confidence: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(routed to large, escalated) masks for one operating point."""
    to_large = scores >= threshold
    if tau is None or confidence is None:
        return to_large, np.zeros_like(to_large)
    return to_large, ~to_large & (confidence < tau)


def _quality(served_large: np.ndarray, small: np.ndarray, large: np.ndarray) -> float:
    """Mean score of the answers served: large's where it answered, small's elsewhere."""
    return float(np.where(served_large, large, small).mean())


def _grid(
    scores: np.ndarray,
    small: np.ndarray,
    large: np.ndarray,
    cost_small: np.ndarray | None,
    cost_large: np.ndarray | None,
    confidence: np.ndarray | None,
    grid: int,
) -> list[tuple[float, float, float, float, float, float | None]]:
    """(cost, served-large share, quality, threshold, escalation rate, τ) for every candidate pair."""
    n = len(scores)
    cost_small = np.ones(n) if cost_small is None else cost_small
    cost_large = np.full(n, 10.0) if cost_large is None else cost_large
    taus: list[float | None] = [None]
    if confidence is not None:
        taus += [float(t) for t in _candidates(confidence, TAU_CANDIDATES)[:-1]]
    points = []
    for tau in taus:
        for threshold in _candidates(scores, grid):
            to_large, escalated = outcome(scores, threshold, tau, confidence)
            served_large = to_large | escalated
            quality = _quality(served_large, small, large)
            cost = float(np.where(to_large, cost_large, cost_small + np.where(escalated, cost_large, 0.0)).sum())
            points.append((cost, float(served_large.mean()), quality, float(threshold), float(escalated.mean()), tau))
    return points


def operating_points(
    scores: np.ndarray,
    small: np.ndarray,
    large: np.ndarray,
    *,
    targets: Sequence[float] = QUALITY_TARGETS,
    cost_small: np.ndarray | None = None,
    cost_large: np.ndarray | None = None,
    confidence: np.ndarray | None = None,
    stream_confidence: np.ndarray | None = None,
    grid: int = 201,
) -> list[OperatingPoint]:
    """For each quality target, the cheapest candidate point meeting it (ties: fewer large answers). Cost defaults
    to one unit per small call and ten per large call."""
    scores = np.asarray(scores, dtype=np.float64)
    candidates = sorted(_grid(scores, small, large, cost_small, cost_large, confidence, grid), key=lambda p: p[:2])
    large_quality = float(np.mean(large))
    chosen = []
    for target in targets:
        bar = target * large_quality - 1e-12
        meeting = next((p for p in candidates if p[2] >= bar), None)
        if meeting is None:  # a bar above large-only quality: send everything large
            chosen.append(OperatingPoint(float(scores.min()), None, target, 1.0, 0.0))
            continue
        _, _, _, threshold, escalation, tau = meeting
        to_large = float((scores >= threshold).mean())
        tau_stream = _stream_tau(scores, threshold, small, large, stream_confidence, bar)
        chosen.append(OperatingPoint(threshold, tau, target, to_large, escalation, tau_stream))
    return chosen


def _stream_tau(scores: np.ndarray, threshold: float, small: np.ndarray, large: np.ndarray,
                stream_confidence: np.ndarray | None, bar: float) -> float | None:
    """The lowest τ on the stream confidences that keeps quality ≥ bar at this threshold; None without them, and
    None where the threshold alone keeps the bar: a τ that escalates nothing would still hold every routed small
    stream back for its decision window."""
    if stream_confidence is None or _quality(scores >= threshold, small, large) >= bar:
        return None
    for tau in _candidates(stream_confidence, TAU_CANDIDATES)[:-1]:
        to_large, escalated = outcome(scores, threshold, float(tau), stream_confidence)
        if _quality(to_large | escalated, small, large) >= bar:
            return float(tau)
    return float(np.nextafter(stream_confidence.max(), np.inf))  # escalate every small answer


def tune(scores: np.ndarray, small: np.ndarray, large: np.ndarray, *, quality_target: float, **kwargs: object
         ) -> OperatingPoint:
    """The cheapest operating point whose quality is >= quality_target × large-only quality."""
    return operating_points(scores, small, large, targets=(quality_target,), **kwargs)[0]  # type: ignore[arg-type]
