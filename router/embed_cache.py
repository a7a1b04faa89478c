"""Prompt embeddings for training, evaluation and benchmarks, kept on disk between runs.

Embedding 15k prompts takes minutes on a small CPU; every train/eval/bench run over the same file would redo it.
The cache is one `.npz` per embedder version, keyed by the sha256 of each prompt, so different files share entries.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

DEFAULT_CACHE_DIR = Path("var/embeddings")


class SupportsEmbed(Protocol):
    version: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def _key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def _path(cache_dir: Path, version: str) -> Path:
    return cache_dir / f"{hashlib.sha256(version.encode()).hexdigest()[:16]}.npz"


def embed_cached(
    embedder: SupportsEmbed, prompts: Sequence[str], cache_dir: Path = DEFAULT_CACHE_DIR, chunk: int = 512
) -> np.ndarray:
    """Embeddings of `prompts` (float32, (n, dim)), computing only those not cached; saves after each chunk."""
    path = _path(cache_dir, embedder.version)
    known: dict[str, np.ndarray] = {}
    if path.exists():
        with np.load(path) as data:
            known = dict(zip(data["keys"].tolist(), data["vectors"], strict=True))
    keys = [_key(p) for p in prompts]
    by_key = dict(zip(keys, prompts, strict=True))
    # Longest first, so that each batch pads to similar lengths (and a too-long prompt fails fast).
    missing = sorted(dict.fromkeys(k for k in keys if k not in known), key=lambda k: -len(by_key[k]))
    for start in range(0, len(missing), chunk):
        batch = missing[start : start + chunk]
        known.update(zip(batch, embedder.embed([by_key[k] for k in batch]), strict=True))
        _save(path, known)
    if not keys:
        return np.zeros((0, embedder.dim), np.float32)
    return np.stack([known[k] for k in keys]).astype(np.float32)


def _save(path: Path, known: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, keys=np.array(list(known)), vectors=np.stack(list(known.values())))
    os.replace(tmp, path)


def lookup(version: str, prompts: Sequence[str], cache_dir: Path = DEFAULT_CACHE_DIR) -> tuple[np.ndarray, np.ndarray]:
    """(vectors, found) for prompts already cached under `version`, computing nothing; rows not found are zero."""
    path = _path(cache_dir, version)
    known: dict[str, np.ndarray] = {}
    if path.exists():
        with np.load(path) as data:
            known = dict(zip(data["keys"].tolist(), data["vectors"], strict=True))
    found = np.array([_key(p) in known for p in prompts], dtype=bool)
    dim = next(iter(known.values())).shape[0] if known else 384
    vectors = np.zeros((len(prompts), dim), np.float32)
    for i, prompt in enumerate(prompts):
        if found[i]:
            vectors[i] = known[_key(prompt)]
    return vectors, found
