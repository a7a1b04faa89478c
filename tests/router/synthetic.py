"""A tiny, learnable routing problem: "hard" prompts (the large tier needed) and "easy" ones, with embeddings that
separate them along one axis, so a classifier trained in a test has something real to find."""

from __future__ import annotations

import numpy as np

from router.data import TrainingRow

DIM = 384


def embed(prompts: list[str], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(len(prompts), DIM))
    vectors[:, 0] += np.array([3.0 if p.startswith("Prove") else -3.0 for p in prompts])
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def rows(n: int = 120) -> list[TrainingRow]:
    out = []
    for i in range(n):
        if i % 3 == 0:  # hard: only the large tier answers
            out.append(TrainingRow(f"Prove that sum_(k=1)^{i} k^3 = (n(n+1)/2)^2 for n = {i}", 0.0, 1.0, 0.2))
        else:  # easy: both answer
            out.append(TrainingRow(f"What is the capital of country number {i}?", 1.0, 1.0, 0.9))
    return out
