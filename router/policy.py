"""The classifier's part of a routing decision, as a pure function of the score and the operating point."""

from __future__ import annotations

from router.artifact import OperatingPoint

SMALL, LARGE = "small", "large"


def choose_tier(score: float | None, point: OperatingPoint | None, pinned: str | None) -> tuple[str, str]:
    """(tier, reason). A feature's pinned tier wins ("pinned"); without a score or an operating point the small tier
    serves ("no_classifier", the cascade may still escalate); otherwise a score at or above the threshold goes large
    ("classifier_large"), below it small ("classifier_small")."""
    if pinned is not None:
        return pinned, "pinned"
    if score is None or point is None:
        return SMALL, "no_classifier"
    if score >= point.threshold:
        return LARGE, "classifier_large"
    return SMALL, "classifier_small"
