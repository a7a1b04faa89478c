"""`sluice router eval`: how a router does on rows in the training format, as numbers and a plot.

Quality is the mean score of the answers served. Cost uses the tier prices per 1M tokens with prompt tokens
estimated from length (`router.tune.CHARS_PER_TOKEN`) and a fixed answer length; an escalated request pays for the
abandoned small attempt and the large answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from router.artifact import OperatingPoint
from router.data import TrainingRow, tier_scores
from router.metrics import apgr, cpt, full_curve, large_fraction_for, oracle_scores, routing_curve
from router.tune import CHARS_PER_TOKEN, Prices, outcome, request_costs


@dataclass(frozen=True, slots=True)
class Evaluation:
    metrics: dict[str, Any]
    scores: np.ndarray
    small: np.ndarray
    large: np.ndarray


def evaluate(
    rows: Sequence[TrainingRow], scores: np.ndarray, point: OperatingPoint, prices: Prices, output_tokens: float
) -> Evaluation:
    small, large = tier_scores(rows)
    confidences = [r.small_confidence for r in rows]
    confidence = None if any(c is None for c in confidences) else np.array(confidences, dtype=np.float64)
    curve = routing_curve(scores, small, large)
    to_large, escalated = outcome(scores, point.threshold, point.tau, confidence)
    routed_quality = float(np.where(to_large | escalated, large, small).mean())
    prompts = [r.prompt for r in rows]
    cost_small, cost_large = request_costs(prompts, prices, output_tokens)
    routed_cost = np.where(to_large, cost_large, cost_small + np.where(escalated, cost_large, 0.0)).sum()
    tokens = float(sum(len(p) for p in prompts) / CHARS_PER_TOKEN + output_tokens * len(rows)) / 1e6
    metrics: dict[str, Any] = {
        "rows": len(rows),
        "apgr": apgr(curve),
        "cpt50": cpt(curve, 0.5),
        "cpt80": cpt(curve, 0.8),
        "large_fraction_for_95": large_fraction_for(full_curve(scores, small, large), 0.95),
        "operating_point": {"threshold": point.threshold, "tau": point.tau, "quality_target": point.quality_target},
        "large_fraction": float(to_large.mean()),
        "escalation_rate": float(escalated.mean()) if confidence is not None else None,
        "small_quality": curve.small_quality,
        "large_quality": curve.large_quality,
        "routed_quality": routed_quality,
        "quality_delta": routed_quality - curve.large_quality,
        "quality_share_of_large": routed_quality / curve.large_quality if curve.large_quality else None,
        "cost_per_mtok_routed": float(routed_cost / tokens),
        "cost_per_mtok_small_only": float(cost_small.sum() / tokens),
        "cost_per_mtok_large_only": float(cost_large.sum() / tokens),
        "savings_vs_large_only": float(1.0 - routed_cost / cost_large.sum()),
        "assumed_output_tokens": output_tokens,
    }
    return Evaluation(metrics, np.asarray(scores, dtype=np.float64), small, large)


def plot(evaluation: Evaluation, path: Path, title: str) -> Path:
    """Quality against large-call fraction: this router, random routing and the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = full_curve(evaluation.scores, evaluation.small, evaluation.large)
    oracle = full_curve(oracle_scores(evaluation.small, evaluation.large), evaluation.small, evaluation.large)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ours.large_fraction, ours.quality, label="router")
    ax.plot([0, 1], [ours.small_quality, ours.large_quality], linestyle="--", label="random")
    ax.plot(oracle.large_fraction, oracle.quality, linestyle=":", label="oracle")
    ax.axhline(0.95 * ours.large_quality, color="grey", linewidth=0.8, label="95% of large-only")
    m = evaluation.metrics
    ax.scatter([m["large_fraction"]], [m["routed_quality"]], color="black", zorder=3, label="operating point")
    ax.set_xlabel("large-tier calls (share of requests)")
    ax.set_ylabel("quality (mean score)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
