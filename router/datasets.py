"""Public routing data turned into training rows: RouteLLM's MMLU and GSM8K responses (Apache-2.0).

RouteLLM (lm-sys/RouteLLM, `routellm/evals/`) recorded whether Mixtral-8x7B-Instruct (the weak model, our "small")
and GPT-4-1106-preview (the strong model, our "large") answered each MMLU and GSM8K question correctly. As RouteLLM's
own benchmarks do, prompts listed in each benchmark's `contaminated_prompts.jsonl` (too close to its router's
training data) are dropped.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from router.data import TrainingDataError, TrainingRow


def data_dir() -> Path:
    """`$SHARED_DATA_DIR`, else `../shared/data` beside the repository."""
    return Path(os.environ.get("SHARED_DATA_DIR") or Path(__file__).resolve().parent.parent.parent / "shared" / "data")


ROUTELLM_DIR = data_dir() / "routing" / "routellm"
WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
STRONG = "gpt-4-1106-preview"


def _contaminated(path: Path) -> set[str]:
    with path.open() as f:
        return {json.loads(line)["eval_prompt"] for line in f if line.strip()}


def _score(value: str, where: str) -> float:
    if value not in ("True", "False"):
        raise TrainingDataError(f"{where}: expected True/False, got {value!r}")
    return 1.0 if value == "True" else 0.0


def _read(path: Path, drop: set[str]) -> list[TrainingRow]:
    csv.field_size_limit(sys.maxsize)
    with path.open(newline="") as f:
        return [
            TrainingRow(raw["prompt"], _score(raw[WEAK], str(path)), _score(raw[STRONG], str(path)))
            for raw in csv.DictReader(f)
            if raw["prompt"] not in drop
        ]


def routellm_rows(root: Path = ROUTELLM_DIR, benchmarks: tuple[str, ...] = ("mmlu", "gsm8k")) -> list[TrainingRow]:
    """Decontaminated rows of the named benchmarks, MMLU domains in file-name order, then GSM8K."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"RouteLLM data not found at {root} (set SHARED_DATA_DIR or place it at ../shared/data)"
        )
    rows: list[TrainingRow] = []
    if "mmlu" in benchmarks:
        drop = _contaminated(root / "mmlu" / "contaminated_prompts.jsonl")
        for path in sorted((root / "mmlu" / "responses").glob("mmlu_*.csv")):
            rows += _read(path, drop)
    if "gsm8k" in benchmarks:
        drop = _contaminated(root / "gsm8k" / "contaminated_prompts.jsonl")
        rows += _read(root / "gsm8k" / "gsm8k_responses.csv", drop)
    return rows
