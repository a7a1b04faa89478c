"""Shadow runs: the online quality delta between the small tier and the large one.

For a sample of requests the small tier served on its own, the large tier answers too, in the
background (`gateway.shadow` runs them). The two answers are compared here: when both state a final
number (GSM8K style `#### n`, else the last number), agreement is 1 when the numbers match and 0
otherwise ("final_answer"); when either does not, it is the cosine similarity of the two answers'
sentence embeddings ("embedding"). The mean agreement over a feature's shadow runs estimates the
quality the small tier keeps against the large one on real traffic, and the runs are training rows
with the large answer as the reference (`small_score` = agreement, `large_score` = 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from router.data import TrainingRow
from router.label import final_number

FINAL_ANSWER, EMBEDDING = "final_answer", "embedding"


@dataclass(frozen=True, slots=True)
class Agreement:
    score: float  # in [0, 1]
    method: str  # final_answer | embedding


def final_answer_agreement(small: str, large: str) -> float | None:
    """1 / 0 for equal / different final numbers; None when either answer states none."""
    a, b = final_number(small), final_number(large)
    if a is None or b is None:
        return None
    return float(math.isclose(a, b, rel_tol=0.0, abs_tol=1e-6))


def cosine(u: np.ndarray, v: np.ndarray) -> float:
    """Cosine similarity clipped to [0, 1] (opposed sentences are simply not in agreement)."""
    denominator = float(np.linalg.norm(u) * np.linalg.norm(v))
    if denominator == 0.0:
        return 0.0
    return min(1.0, max(0.0, float(np.dot(u, v)) / denominator))


def agreement(small: str, large: str, embeddings: tuple[np.ndarray, np.ndarray] | None = None) -> Agreement | None:
    """Agreement of two answers; None when no final numbers are there and no embeddings were given."""
    exact = final_answer_agreement(small, large)
    if exact is not None:
        return Agreement(exact, FINAL_ANSWER)
    if embeddings is None:
        return None
    return Agreement(cosine(*embeddings), EMBEDDING)


def needs_embeddings(small: str, large: str) -> bool:
    return final_answer_agreement(small, large) is None


def training_rows(runs: Iterable[tuple[str, float]]) -> list[TrainingRow]:
    """(prompt, agreement) pairs → training rows with the large answer as the reference."""
    return [TrainingRow(prompt=prompt, small_score=float(score), large_score=1.0) for prompt, score in runs]
