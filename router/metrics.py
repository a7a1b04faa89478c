"""Router evaluation metrics, defined as RouteLLM defines them (lm-sys/RouteLLM, `routellm/evals/`).

A router gives each prompt a score (higher = more likely to need the large model). RouteLLM sweeps 11 thresholds,
the 0%, 10%, ..., 100% quantiles of the scores (`pd.qcut(scores, 10, retbins=True)`); at each threshold the prompts
with score >= threshold go to the large model (> for the last one, so the sweep ends at 0% large calls). Each point
is (large-call fraction, mean quality of the routed answers).

- **APGR** (average performance gap recovered): the area under that curve minus the small model's area, divided by
  the large model's area minus the small model's, over the curve's large-call range (0..1 in practice).
  0.5 is a random router; 1.0 would need quality = large-only quality at every call fraction.
- **CPT(x%)** (call-performance threshold): the large-call fraction at which the curve reaches
  small + x·(large − small) quality, by linear interpolation with `np.interp(target, quality, fraction)` over the
  points sorted by fraction, exactly as RouteLLM computes it (np.interp assumes quality rises with the fraction; a
  router whose curve dips gets RouteLLM's value, not a re-sorted one).

RouteLLM reports fractions in percent; these functions return fractions in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_THRESHOLDS = 10  # RouteLLM's default --num-results


@dataclass(frozen=True, slots=True)
class Curve:
    """Points (large-call fraction, routed quality) sorted by fraction, and the two single-model qualities."""

    large_fraction: np.ndarray
    quality: np.ndarray
    small_quality: float
    large_quality: float


def routing_curve(
    scores: np.ndarray, small: np.ndarray, large: np.ndarray, num_results: int = NUM_THRESHOLDS
) -> Curve:
    """RouteLLM's threshold sweep: thresholds at the 0, 1/n, ..., 1 quantiles of `scores`."""
    scores, small, large = (np.asarray(a, dtype=np.float64) for a in (scores, small, large))
    if not len(scores) == len(small) == len(large) or len(scores) == 0:
        raise ValueError("scores, small and large must be non-empty and the same length")
    thresholds = np.quantile(scores, np.linspace(0.0, 1.0, num_results + 1))
    fractions, qualities = [], []
    for i, threshold in enumerate(thresholds):
        to_large = scores >= threshold if i != len(thresholds) - 1 else scores > threshold
        fractions.append(to_large.mean())
        qualities.append(np.where(to_large, large, small).mean())
    order = np.argsort(fractions, kind="stable")
    return Curve(
        np.asarray(fractions)[order], np.asarray(qualities)[order], float(small.mean()), float(large.mean())
    )


def apgr(curve: Curve) -> float:
    x = curve.large_fraction
    span = x[-1] - x[0]
    auc = float(np.trapezoid(curve.quality, x))
    small_auc, large_auc = curve.small_quality * span, curve.large_quality * span
    return (auc - small_auc) / (large_auc - small_auc)


def cpt(curve: Curve, pct: float) -> float:
    target = pct * (curve.large_quality - curve.small_quality) + curve.small_quality
    return float(np.interp(target, curve.quality, curve.large_fraction))


def oracle_scores(small: np.ndarray, large: np.ndarray, seed: int = 0) -> np.ndarray:
    """The oracle's scores: the true gain large − small, ties broken at random so that quantile thresholds differ."""
    gain = np.asarray(large, dtype=np.float64) - np.asarray(small, dtype=np.float64)
    return gain + np.random.default_rng(seed).uniform(0.0, 1e-3, len(gain))


def full_curve(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> Curve:
    """Every threshold at once (the k highest-scored prompts go large, k = 0..n): for plots and operating points."""
    scores, small, large = (np.asarray(a, dtype=np.float64) for a in (scores, small, large))
    order = np.argsort(-scores, kind="stable")
    gain = np.concatenate([[0.0], np.cumsum((large - small)[order])])
    n = len(scores)
    return Curve(np.arange(n + 1) / n, (small.sum() + gain) / n, float(small.mean()), float(large.mean()))


def large_fraction_for(curve: Curve, quality_share: float) -> float:
    """The smallest large-call fraction whose routed quality reaches `quality_share` × large-only quality."""
    reached = np.nonzero(curve.quality >= quality_share * curve.large_quality - 1e-12)[0]
    return float(curve.large_fraction[reached[0]]) if len(reached) else 1.0
