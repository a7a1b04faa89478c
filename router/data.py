"""Router training rows: one prompt with how well each tier answered it.

The file format (`sluice router train --data`, `sluice router label` output, `bench/router.py --data`) is JSONL or CSV
with columns `prompt, small_score, large_score` (scores in [0, 1]: 1 = answered correctly) and, when the rows come
from our own tiers, `small_confidence` and `small_stream_confidence` (the small tier's confidence in its complete
answer and in its first tokens, see `router.confidence`), which let tuning pick the cascade's escalation thresholds.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("prompt", "small_score", "large_score", "small_confidence", "small_stream_confidence")
OPTIONAL = ("small_confidence", "small_stream_confidence")


class TrainingDataError(ValueError):
    """A training file is malformed; the message names the file, the row and the column."""


@dataclass(frozen=True, slots=True)
class TrainingRow:
    prompt: str
    small_score: float
    large_score: float
    small_confidence: float | None = None
    small_stream_confidence: float | None = None


def tier_scores(rows: Sequence[TrainingRow]) -> tuple[np.ndarray, np.ndarray]:
    """(small_score, large_score) of each row, as two float64 arrays: what the routing metrics take."""
    return np.array([r.small_score for r in rows], dtype=np.float64), np.array([r.large_score for r in rows],
                                                                               dtype=np.float64)


def _row(raw: dict[str, object], where: str) -> TrainingRow:
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise TrainingDataError(f"{where}: `prompt` must be a non-empty string")
    scores: dict[str, float | None] = {}
    for column in COLUMNS[1:]:
        value = raw.get(column)
        if value in (None, "") and column in OPTIONAL:
            scores[column] = None
            continue
        try:
            scores[column] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise TrainingDataError(f"{where}: `{column}` must be a number, got {value!r}") from exc
        if column not in OPTIONAL and not 0.0 <= scores[column] <= 1.0:  # type: ignore[operator]
            raise TrainingDataError(f"{where}: `{column}` must be in [0, 1], got {value!r}")
    return TrainingRow(prompt, **scores)  # type: ignore[arg-type]


def load_rows(path: str | Path) -> list[TrainingRow]:
    """Rows of a `.jsonl` or `.csv` file in the training format."""
    path = Path(path)
    if not path.exists():
        raise TrainingDataError(f"{path}: no such file")
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return [_row(raw, f"{path}:{i + 2}") for i, raw in enumerate(csv.DictReader(f))]
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainingDataError(f"{path}:{i + 1}: not JSON ({exc})") from exc
            if not isinstance(raw, dict):
                raise TrainingDataError(f"{path}:{i + 1}: each line must be a JSON object")
            rows.append(_row(raw, f"{path}:{i + 1}"))
    return rows


def write_rows(path: str | Path, rows: Iterable[TrainingRow]) -> None:
    """Write rows as JSONL (or CSV when the name ends in .csv)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for row in rows:
                writer.writerow(asdict(row))
        return
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")
