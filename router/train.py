"""Training a difficulty classifier from rows of (prompt, small_score, large_score) and writing its artifact.

The label is "the large tier was needed": large_score > small_score (for 0/1 scores, large right and small wrong),
each row weighted by how much it matters, |large_score − small_score| (ties weigh `TIE_WEIGHT`), so rows scored on a
continuous scale (judge ratings) count by their gap. The model is a logistic regression on standardised
[MiniLM embedding | lexical] features with sigmoid calibration, exported with skl2onnx and run by onnxruntime,
blended with k-nearest-neighbour smoothing (`router.neighbours`) and a TF-IDF word-n-gram regression on the same label
(`router.ngrams`), each blend weight chosen on the validation split.

The rows are split 80/20 (seed): the model is fitted on the 80% and the validation 20% gives the metrics and the
operating-point table stored with the artifact (thresholds chosen on rows the model never saw).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from skl2onnx import to_onnx
from sklearn.calibration import CalibratedClassifierCV
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from router.artifact import RouterArtifact, write_artifact
from router.data import TrainingDataError, TrainingRow, tier_scores
from router.features import FEATURE_VERSION, LEXICAL_NAMES, feature_matrix
from router.metrics import apgr, cpt, full_curve, large_fraction_for, routing_curve
from router.neighbours import FILE as NEIGHBOURS_FILE
from router.neighbours import NeighbourIndex
from router.ngrams import FILE as NGRAMS_FILE
from router.ngrams import NgramModel
from router.tune import operating_points

MIN_ROWS = 20
TIE_WEIGHT = 0.25
C = 0.01  # inverse L2 strength, chosen on the RouteLLM validation split (see BENCHMARKS.md)
NEIGHBOUR_KS = (25, 50, 100, 200)
BLEND_WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)  # weight of the regression; the rest goes to neighbour smoothing
NGRAM_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)  # weight of the n-gram regression against that blend


def split_indices(n: int, seed: int = 0, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) row indices: a random permutation, the first `test_fraction` held out."""
    order = np.random.default_rng(seed).permutation(n)
    n_test = round(test_fraction * n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def fingerprint(rows: Sequence[TrainingRow]) -> str:
    """sha256 over the rows in order (prompt and scores), as recorded with each artifact."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(asdict(row), sort_keys=True).encode() + b"\n")
    return digest.hexdigest()


def labels(rows: Sequence[TrainingRow]) -> tuple[np.ndarray, np.ndarray]:
    """(label, sample weight) per row: the large tier needed, weighted by the score gap."""
    small, large = tier_scores(rows)
    gain = large - small
    return (gain > 0).astype(np.int64), np.where(gain == 0, TIE_WEIGHT, np.abs(gain))


def fit_classifier(features: np.ndarray, rows: Sequence[TrainingRow], seed: int = 0) -> Pipeline:
    y, weight = labels(rows)
    if len(set(y.tolist())) < 2:
        raise TrainingDataError("training rows need both outcomes: some where large beat small, some where not")
    folds = int(min(3, np.bincount(y).min()))
    model = LogisticRegression(C=C, max_iter=3000, random_state=seed)
    calibrated = CalibratedClassifierCV(model, method="sigmoid", cv=folds) if folds >= 2 else model
    pipeline = make_pipeline(StandardScaler(), calibrated)
    pipeline.fit(features, y, **{f"{pipeline.steps[-1][0]}__sample_weight": weight})
    return pipeline


def choose_blend(
    regression: np.ndarray, embeddings: np.ndarray, index: NeighbourIndex, rows: Sequence[TrainingRow]
) -> tuple[float, int, np.ndarray]:
    """(regression weight, k, blended scores) with the best APGR over every threshold on the validation rows."""
    small, large = tier_scores(rows)
    best: tuple[float, float, int, np.ndarray] | None = None
    for k in NEIGHBOUR_KS:
        index.k = k
        smoothed = index.score(embeddings)
        for weight in BLEND_WEIGHTS:
            scores = weight * regression + (1.0 - weight) * smoothed
            value = apgr(full_curve(scores, small, large))
            if best is None or value > best[0] + 1e-9:
                best = (value, weight, k, scores)
    assert best is not None
    index.k = best[2]
    return best[1], best[2], best[3]


def choose_ngram_weight(blend: np.ndarray, ngrams: np.ndarray, rows: Sequence[TrainingRow]) -> tuple[float, np.ndarray]:
    """(n-gram weight, scores) with the best APGR on the validation rows; ties keep the smaller weight."""
    small, large = tier_scores(rows)
    best: tuple[float, float, np.ndarray] | None = None
    for weight in NGRAM_WEIGHTS:
        scores = (1.0 - weight) * blend + weight * ngrams
        value = apgr(full_curve(scores, small, large))
        if best is None or value > best[0] + 1e-9:
            best = (value, weight, scores)
    assert best is not None
    return best[1], best[2]


def fit_ngrams(rows: Sequence[TrainingRow], seed: int = 0) -> NgramModel | None:
    """The n-gram regression, or None when the rows share too few words for a vocabulary (terms in ≥ 2 prompts)."""
    y, weight = labels(rows)
    try:
        return NgramModel.fit([r.prompt for r in rows], y, weight, seed)
    except ValueError:  # scikit-learn: "After pruning, no terms remain"
        return None


def validation_metrics(scores: np.ndarray, rows: Sequence[TrainingRow]) -> dict[str, float]:
    small, large = tier_scores(rows)
    curve = routing_curve(scores, small, large)
    return {
        "rows": len(rows),
        "apgr": apgr(curve),
        "cpt50": cpt(curve, 0.5),
        "cpt80": cpt(curve, 0.8),
        "large_fraction_for_95": large_fraction_for(full_curve(scores, small, large), 0.95),
        "small_quality": curve.small_quality,
        "large_quality": curve.large_quality,
    }


def _embed(prompts: list[str]) -> tuple[np.ndarray, str]:
    from router.embed_cache import embed_cached
    from router.embedding import Embedder

    embedder = Embedder.load()
    return embed_cached(embedder, prompts), embedder.version


def train_router(
    rows: list[TrainingRow],
    out_dir: Path,
    *,
    quality_target: float = 0.95,
    seed: int = 0,
    embeddings: np.ndarray | None = None,
    embedder_version: str | None = None,
) -> RouterArtifact:
    """Fit, validate, pick operating points and write a new version under `out_dir` (LATEST points at it).
    `embeddings` (one MiniLM row per prompt) skips embedding the prompts here."""
    if len(rows) < MIN_ROWS:
        raise TrainingDataError(f"need at least {MIN_ROWS} training rows, got {len(rows)}")
    prompts = [r.prompt for r in rows]
    if embeddings is None:
        embeddings, embedder_version = _embed(prompts)
    features = feature_matrix(embeddings, prompts)
    fit, val = split_indices(len(rows), seed)
    model = fit_classifier(features[fit], [rows[i] for i in fit], seed)
    val_rows = [rows[i] for i in val]
    index = NeighbourIndex.fit(embeddings[fit], labels([rows[i] for i in fit])[0].astype(np.float32), k=1)
    weight, k, scores = choose_blend(model.predict_proba(features[val])[:, 1], embeddings[val], index, val_rows)
    ngrams = fit_ngrams([rows[i] for i in fit], seed)
    ngram_weight = 0.0
    if ngrams is not None:
        ngram_weight, scores = choose_ngram_weight(scores, ngrams.score([r.prompt for r in val_rows]), val_rows)
    small, large = tier_scores(val_rows)
    points = operating_points(scores, small, large)
    onnx_model = to_onnx(model, features[:1], options={id(model): {"zipmap": False}}, target_opset=17)
    digest = fingerprint(rows)
    meta: dict[str, Any] = {
        "version": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{digest[:8]}",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "features": {
            "version": FEATURE_VERSION,
            "embedder": embedder_version,
            "embedding_dim": int(embeddings.shape[1]),
            "lexical": list(LEXICAL_NAMES),
        },
        "model": "StandardScaler + LogisticRegression (sigmoid-calibrated) blended with k-nearest-neighbour "
        "smoothing (router.neighbours) and a TF-IDF word 1-2-gram LogisticRegression (router.ngrams); label: "
        "large_score > small_score",
        "score": {
            "class_index": 1,
            "regression_weight": weight,
            "neighbours_k": k if weight < 1.0 else None,
            "ngram_weight": ngram_weight,
            "meaning": "P(the large tier is needed): (1 − ngram_weight) × (regression_weight × the model's "
            "probability + the rest × the share of the k nearest training prompts that needed it) + ngram_weight × "
            "the n-gram regression's probability",
        },
        "training_data": {"sha256": digest, "rows": len(rows), "fit_rows": len(fit), "seed": seed},
        "validation": validation_metrics(scores, val_rows),
        "operating_points": [asdict(p) for p in points],
        "default_quality_target": quality_target,
        "tuned_on": "validation split",
    }
    extra = {NEIGHBOURS_FILE: index.to_bytes()} if weight < 1.0 else {}
    if ngrams is not None and ngram_weight > 0.0:
        extra[NGRAMS_FILE] = ngrams.to_bytes()
    return RouterArtifact.load(write_artifact(Path(out_dir), onnx_model.SerializeToString(), meta, extra))
