"""Neighbour smoothing: a prompt's score from the outcomes of the most similar training prompts.

Difficulty is largely a property of the topic and the kind of task, which nearby prompts share; averaging the
labels of the k nearest training prompts (cosine similarity of MiniLM embeddings) estimates it with little variance.
To keep the artifact small, embeddings are projected onto their top `DIMS` principal components (float16).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

DIMS = 64
FILE = "neighbours.npz"


class NeighbourIndex:
    def __init__(self, mean: np.ndarray, components: np.ndarray, points: np.ndarray, labels: np.ndarray,
                 k: int) -> None:
        self.mean = mean.astype(np.float32)
        self.components = components.astype(np.float32)
        self.points = points.astype(np.float16)  # what the artifact stores
        self._points32 = self.points.astype(np.float32)  # what a lookup multiplies (numpy has no fast float16 matmul)
        self.labels = labels.astype(np.float32)
        self.k = k

    @classmethod
    def fit(cls, embeddings: np.ndarray, labels: np.ndarray, k: int, dims: int = DIMS) -> NeighbourIndex:
        mean = embeddings.mean(0)
        # Principal directions of the centred embeddings (SVD; a few hundred columns, so cheap).
        _, _, vt = np.linalg.svd(embeddings - mean, full_matrices=False)
        components = vt[: min(dims, vt.shape[0])]
        projected = _normalised((np.asarray(embeddings, np.float32) - mean) @ components.T)
        return cls(mean, components, projected.astype(np.float16), labels, k)

    def _project(self, embeddings: np.ndarray) -> np.ndarray:
        return _normalised((np.asarray(embeddings, np.float32) - self.mean) @ self.components.T)

    def score(self, embeddings: np.ndarray, exclude_self: bool = False) -> np.ndarray:
        """Mean label of the k nearest indexed prompts; `exclude_self` skips each query's own best match (for
        scoring the indexed prompts themselves)."""
        similarity = self._project(embeddings) @ self._points32.T
        skip = 1 if exclude_self else 0
        k = min(self.k + skip, similarity.shape[1])
        nearest = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
        if skip:
            best = np.take_along_axis(similarity, nearest, 1).argmax(1)
            mask = np.ones_like(nearest, dtype=bool)
            mask[np.arange(len(nearest)), best] = False
            return np.where(mask, self.labels[nearest], 0.0).sum(1) / (k - 1)
        return self.labels[nearest].mean(1)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, mean=self.mean, components=self.components, points=self.points, labels=self.labels,
                 k=np.array(self.k))
        return buffer.getvalue()

    @classmethod
    def load(cls, directory: Path) -> NeighbourIndex:
        with np.load(directory / FILE) as data:
            return cls(data["mean"], data["components"], data["points"], data["labels"], int(data["k"]))


def _normalised(projected: np.ndarray) -> np.ndarray:
    return projected / np.maximum(np.linalg.norm(projected, axis=1, keepdims=True), 1e-9)
