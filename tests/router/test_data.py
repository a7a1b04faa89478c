"""The training-file format: JSONL and CSV read the same rows, and bad rows are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.data import TrainingDataError, TrainingRow, load_rows, write_rows

ROWS = [TrainingRow("2+2?", 1.0, 1.0, -0.9, -0.1), TrainingRow("prove P != NP", 0.0, 0.5, None, None)]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv"])
def test_rows_round_trip_through_either_format(tmp_path: Path, name: str) -> None:
    write_rows(tmp_path / name, ROWS)
    assert load_rows(tmp_path / name) == ROWS


def test_a_score_outside_the_unit_interval_is_refused_naming_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "a", "small_score": 1, "large_score": 1}\n{"prompt": "b", "small_score": 2, "large_score": 1}\n'
    )
    with pytest.raises(TrainingDataError, match=r"bad.jsonl:2: `small_score` must be in \[0, 1\]"):
        load_rows(path)


def test_a_missing_prompt_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("prompt,small_score,large_score\n,1,0\n")
    with pytest.raises(TrainingDataError, match=r"bad\.csv:2: `prompt`"):
        load_rows(path)


def test_confidences_are_optional_and_may_be_below_zero(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("prompt,small_score,large_score\nq,1,0\n")
    assert load_rows(path) == [TrainingRow("q", 1.0, 0.0)]
    path.write_text("prompt,small_score,large_score,small_confidence,small_stream_confidence\nq,1,0,-7.5,-0.25\n")
    assert load_rows(path) == [TrainingRow("q", 1.0, 0.0, -7.5, -0.25)]
