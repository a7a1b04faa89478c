"""Labelled question pairs (QQP via GPTCache's benchmark) and their reproducible split.

A pair is `{"text_a", "text_b", "label"}` with label 1 when both ask the same thing. The split keeps
every question in one split: questions linked by any pair form a component (union-find), and the
component goes to train / validation / test by a hash of its smallest normalised question. So the
held-out test has no question the matcher saw in training, and the split never depends on file order.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# The shared data folder sits beside the repository; SLUICE_SHARED_DATA points elsewhere (a git worktree).
SHARED_DATA = Path(os.environ.get("SLUICE_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"))
DEFAULT_PAIRS = SHARED_DATA / "semcache" / "qqp_pairs.jsonl.gz"
# Buckets out of 100: [0, 80) train, [80, 90) validation, [90, 100) test.
SPLIT_BUCKETS = {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}


@dataclass(frozen=True, slots=True)
class Pair:
    text_a: str
    text_b: str
    label: int


def load_pairs(path: Path) -> list[Pair]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Pair(str(r["text_a"]), str(r["text_b"]), int(r["label"])) for r in rows]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100


def split_pairs(pairs: Iterable[Pair]) -> dict[str, list[Pair]]:
    """train / validation / test with no question in two splits (see the module docstring)."""
    pairs = list(pairs)
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        ra, rb = find(_norm(p.text_a)), find(_norm(p.text_b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the root is always the component's smallest question
    out: dict[str, list[Pair]] = {name: [] for name in SPLIT_BUCKETS}
    for p in pairs:
        bucket = _bucket(find(_norm(p.text_a)))
        name = next(n for n, (lo, hi) in SPLIT_BUCKETS.items() if lo <= bucket < hi)
        out[name].append(p)
    return out
