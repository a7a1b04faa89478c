"""A trained router on disk, and the watcher that swaps in a newer one without a restart.

Layout: `<root>/<version>/model.onnx` + `meta.json`, and `<root>/LATEST` naming the newest version. Writers build a
version in a temporary directory, rename it into place, then replace `LATEST` atomically, so a reader never sees a
half-written artifact. `RouterArtifact.load` takes either a root (follows `LATEST`) or one version directory.

meta.json holds the feature spec (embedder, lexical feature names, feature version), how the score is read from the
model's class probabilities, the operating-point table (one per quality target 0.80 … 1.00), the training data's
fingerprint and the metrics on the validation split the operating points were chosen on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from router.features import FEATURE_VERSION, feature_matrix
from router.neighbours import FILE as NEIGHBOURS_FILE
from router.neighbours import NeighbourIndex
from router.ngrams import FILE as NGRAMS_FILE
from router.ngrams import NgramModel

log = logging.getLogger("sluice.router")
LATEST = "LATEST"
MODEL_FILE = "model.onnx"
META_FILE = "meta.json"
DEFAULT_ARTIFACT_DIR = Path(__file__).resolve().parent / "default"


class ArtifactError(ValueError):
    """A router artifact is missing, incomplete or was built for other features."""


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """Where to cut: prompts scoring >= `threshold` go to the large tier; a small answer whose confidence is below
    `tau` (complete answers) or `tau_stream` (streams) is escalated (None: no cascade on that path; the two
    confidence definitions are in `router.confidence`). The expectations are shares of all requests on the tuning
    data, for complete answers."""

    threshold: float
    tau: float | None
    quality_target: float
    expected_large_fraction: float
    expected_escalation_rate: float
    tau_stream: float | None = None


class RouterArtifact:
    def __init__(self, path: Path, meta: dict[str, Any], session: ort.InferenceSession,
                 neighbours: NeighbourIndex | None = None, ngrams: NgramModel | None = None) -> None:
        self.path = path
        self.meta = meta
        self._session = session
        self._neighbours = neighbours
        self._ngrams = ngrams
        self._weight = float(meta["score"].get("regression_weight", 1.0))
        self._ngram_weight = float(meta["score"].get("ngram_weight", 0.0)) if ngrams is not None else 0.0
        self._input = session.get_inputs()[0].name
        self._points = sorted(
            (OperatingPoint(**p) for p in meta["operating_points"]), key=lambda p: p.quality_target
        )

    @property
    def version(self) -> str:
        return str(self.meta["version"])

    @classmethod
    def load(cls, path: str | Path) -> RouterArtifact:
        path = resolve_version(Path(path))
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path}: cannot read {META_FILE} ({exc})") from exc
        if meta.get("features", {}).get("version") != FEATURE_VERSION:
            raise ArtifactError(
                f"{path}: built for features {meta.get('features', {}).get('version')!r}, this code computes "
                f"{FEATURE_VERSION!r}; retrain it"
            )
        _drop_stale_taus(path, meta)
        options = ort.SessionOptions()
        # One thread: requests arrive concurrently, and a 400-wide linear model gains nothing from more.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(path / MODEL_FILE), options, providers=["CPUExecutionProvider"])
        neighbours = NeighbourIndex.load(path) if (path / NEIGHBOURS_FILE).exists() else None
        ngrams = NgramModel.load(path) if (path / NGRAMS_FILE).exists() else None
        if (ngrams is None) != (float(meta["score"].get("ngram_weight", 0.0)) == 0.0):
            raise ArtifactError(f"{path}: meta.json's ngram_weight and the presence of {NGRAMS_FILE} disagree")
        return cls(path, meta, session, neighbours, ngrams)

    def score(self, embeddings: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """P(the large tier is needed) per prompt, float64 in [0, 1]; higher = harder."""
        if len(prompts) == 0:
            return np.zeros(0)
        features = feature_matrix(embeddings, prompts)
        probabilities = self._session.run(None, {self._input: features})[1]
        scores = np.asarray(probabilities, dtype=np.float64)[:, int(self.meta["score"]["class_index"])]
        if self._neighbours is not None and self._weight < 1.0:
            smoothed = self._neighbours.score(embeddings).astype(np.float64)
            scores = self._weight * scores + (1.0 - self._weight) * smoothed
        if self._ngrams is not None:
            scores = (1.0 - self._ngram_weight) * scores + self._ngram_weight * self._ngrams.score(prompts)
        return scores

    @property
    def operating_points(self) -> list[OperatingPoint]:
        return list(self._points)

    def operating_point(self, quality_target: float | None = None) -> OperatingPoint:
        """The stored point for `quality_target` (default: the one chosen at training or tuning); between table
        entries the next stricter target is used, so quality never falls below what was asked."""
        target = float(self.meta["default_quality_target"] if quality_target is None else quality_target)
        for point in self._points:
            if point.quality_target >= target - 1e-9:
                return point
        return self._points[-1]


def _drop_stale_taus(path: Path, meta: dict[str, Any]) -> None:
    """τs tuned before the confidence had a definition per path (meta.json without `confidence`) were chosen on
    another statistic: they are dropped (classifier-only routing) until `sluice router tune` runs again."""
    if meta.get("confidence") or not any(p.get("tau") is not None for p in meta["operating_points"]):
        return
    log.warning("%s: its cascade τ was tuned on an older confidence definition and is ignored; run "
                "`sluice router tune` again", path)
    for point in meta["operating_points"]:
        point["tau"] = point["tau_stream"] = None


def resolve_version(path: Path) -> Path:
    """A version directory: `path` itself when it holds meta.json, else the version its LATEST names."""
    if (path / META_FILE).exists():
        return path
    latest = path / LATEST
    if not latest.exists():
        raise ArtifactError(f"{path}: not a router artifact (no {META_FILE} and no {LATEST})")
    version = latest.read_text().strip()
    if not (path / version / META_FILE).exists():
        raise ArtifactError(f"{path}: {LATEST} names {version!r}, which has no {META_FILE}")
    return path / version


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _point_latest(root: Path, version: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(version + "\n")
    os.replace(tmp, root / LATEST)


def write_artifact(root: Path, model: bytes, meta: dict[str, Any], extra: dict[str, bytes] | None = None) -> Path:
    """Write a new version (model, meta and any extra files) under `root` and point LATEST at it; returns the
    version directory."""
    root.mkdir(parents=True, exist_ok=True)
    version = str(meta["version"])
    staging = root / f".{version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    (staging / MODEL_FILE).write_bytes(model)
    for name, data in (extra or {}).items():
        (staging / name).write_bytes(data)
    write_json_atomic(staging / META_FILE, meta)
    os.replace(staging, root / version)
    _point_latest(root, version)
    return root / version


def store_operating_points(version_dir: Path, points: Sequence[OperatingPoint], default_target: float,
                           extra: dict[str, Any] | None = None) -> None:
    """Replace a version's operating-point table (after tuning) and re-point LATEST so that watchers reload it."""
    meta = json.loads((version_dir / META_FILE).read_text())
    meta["operating_points"] = [asdict(p) for p in points]
    meta["default_quality_target"] = default_target
    meta.update(extra or {})
    write_json_atomic(version_dir / META_FILE, meta)
    if (version_dir.parent / LATEST).exists():
        _point_latest(version_dir.parent, version_dir.name)


class ArtifactWatcher:
    """`.current` is the newest artifact under `path`; LATEST's mtime is checked at most once per `poll_s`."""

    def __init__(self, path: str | Path, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._stamp = self._latest_stamp()
        self._current = RouterArtifact.load(self.path)
        self._checked = time.monotonic()

    def _latest_stamp(self) -> tuple[int, int] | None:
        for name in (LATEST, META_FILE):
            try:
                stat = (self.path / name).stat()
            except FileNotFoundError:
                continue
            return stat.st_mtime_ns, stat.st_size
        return None

    @property
    def current(self) -> RouterArtifact:
        now = time.monotonic()
        if now - self._checked < self.poll_s:
            return self._current
        with self._lock:
            self._checked = now
            stamp = self._latest_stamp()
            if stamp != self._stamp:
                try:
                    self._current = RouterArtifact.load(self.path)
                    self._stamp = stamp
                except ArtifactError:
                    pass  # a broken new version keeps the old one serving; the next poll tries again
        return self._current
