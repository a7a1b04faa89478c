"""A classifier trained in the test on synthetic rows: it is written, reloaded, scores like the fitted model,
routes hard prompts large, and a newer version is picked up by the watcher without a restart."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from router.artifact import LATEST, ArtifactError, ArtifactWatcher, OperatingPoint, RouterArtifact
from router.data import TrainingDataError, TrainingRow
from router.policy import choose_tier
from router.train import fingerprint, split_indices, train_router
from tests.router import synthetic


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> RouterArtifact:
    rows = synthetic.rows()
    prompts = [r.prompt for r in rows]
    return train_router(rows, tmp_path_factory.mktemp("router"), embeddings=synthetic.embed(prompts),
                        embedder_version="synthetic")


def test_the_artifact_records_its_features_data_and_validation(trained: RouterArtifact) -> None:
    meta = json.loads((trained.path / "meta.json").read_text())
    assert meta["version"] == trained.version
    assert (trained.path.parent / LATEST).read_text().strip() == trained.version
    assert meta["training_data"]["sha256"] == fingerprint(synthetic.rows())
    assert meta["features"]["embedder"] == "synthetic"
    assert [p["quality_target"] for p in meta["operating_points"]][0::20] == [0.8, 1.0]
    assert meta["validation"]["apgr"] > 0.8  # separable: the oracle's 0.83 (one row in three needs large)
    assert "Prove" not in (trained.path / "meta.json").read_text()  # no prompt text is stored


def test_hard_prompts_score_high_and_go_large(trained: RouterArtifact) -> None:
    unseen = synthetic.rows(303)[300:302]  # one hard, one easy, numbers the training rows did not have
    prompts = [r.prompt for r in unseen]
    scores = trained.score(synthetic.embed(prompts, seed=5), prompts)
    assert scores.shape == (2,) and scores[0] > scores[1] + 0.2
    point = trained.operating_point(0.95)
    assert choose_tier(float(scores[0]), point, None) == ("large", "classifier_large")
    assert choose_tier(float(scores[1]), point, None) == ("small", "classifier_small")
    assert choose_tier(float(scores[1]), point, "large") == ("large", "pinned")
    assert choose_tier(None, point, None) == ("small", "no_classifier")


def test_scores_are_batched_and_order_preserving(trained: RouterArtifact) -> None:
    prompts = [r.prompt for r in synthetic.rows(10)]
    embeddings = synthetic.embed(prompts, seed=3)
    together = trained.score(embeddings, prompts)
    one_by_one = [trained.score(embeddings[i : i + 1], prompts[i : i + 1])[0] for i in range(len(prompts))]
    assert together == pytest.approx(one_by_one, abs=1e-6)
    assert trained.score(np.zeros((0, 384), np.float32), []).shape == (0,)


def test_a_stricter_target_never_sends_fewer_requests_large(trained: RouterArtifact) -> None:
    fractions = [trained.operating_point(q).expected_large_fraction for q in (0.8, 0.9, 0.95, 1.0)]
    assert fractions == sorted(fractions)
    # Between table entries the next stricter one is used.
    assert trained.operating_point(0.955).quality_target == pytest.approx(0.96)


def test_too_few_rows_or_one_outcome_only_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TrainingDataError, match="at least 20"):
        train_router(synthetic.rows(5), tmp_path, embeddings=synthetic.embed(["x"] * 5))
    same = [TrainingRow(f"q{i}", 1.0, 1.0) for i in range(40)]
    with pytest.raises(TrainingDataError, match="both outcomes"):
        train_router(same, tmp_path, embeddings=synthetic.embed([r.prompt for r in same]))


def test_a_directory_without_an_artifact_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not a router artifact"):
        RouterArtifact.load(tmp_path)


def test_the_watcher_picks_up_a_new_version_without_a_restart(tmp_path: Path) -> None:
    rows = synthetic.rows()
    embeddings = synthetic.embed([r.prompt for r in rows])
    first = train_router(rows, tmp_path, embeddings=embeddings)
    watcher = ArtifactWatcher(tmp_path, poll_s=0.05)
    assert watcher.current.version == first.version
    time.sleep(1.1)  # versions are named to the second
    second = train_router(rows[::-1], tmp_path, embeddings=embeddings[::-1])
    assert second.version != first.version
    time.sleep(0.1)
    assert watcher.current.version == second.version
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted(
        [first.version, second.version, LATEST]
    )


def test_the_watcher_keeps_serving_when_latest_names_a_broken_version(tmp_path: Path) -> None:
    rows = synthetic.rows()
    good = train_router(rows, tmp_path, embeddings=synthetic.embed([r.prompt for r in rows]))
    watcher = ArtifactWatcher(tmp_path, poll_s=0.0)
    (tmp_path / LATEST).write_text("no-such-version\n")
    os.utime(tmp_path / LATEST, ns=(time.time_ns() + 10**9,) * 2)
    assert watcher.current.version == good.version


def test_split_is_a_seeded_80_20_partition() -> None:
    train, test = split_indices(100, seed=0)
    assert len(train) == 80 and len(test) == 20
    assert sorted([*train, *test]) == list(range(100))
    assert split_indices(100, seed=0)[1].tolist() == test.tolist()


def test_operating_point_is_a_plain_record() -> None:
    point = OperatingPoint(threshold=0.4, tau=None, quality_target=0.95, expected_large_fraction=0.3,
                           expected_escalation_rate=0.0)
    assert choose_tier(0.4, point, None)[0] == "large"


def test_taus_tuned_before_the_per_path_confidences_are_dropped_not_misread(tmp_path: Path, caplog) -> None:
    rows = synthetic.rows()
    artifact = train_router(rows, tmp_path, embeddings=synthetic.embed([r.prompt for r in rows]))
    meta_path = artifact.path / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["operating_points"][0]["tau"] = -0.2  # an older artifact: one τ, no `confidence` definitions
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="sluice.router"):
        reloaded = RouterArtifact.load(tmp_path)
    assert all(p.tau is None and p.tau_stream is None for p in reloaded.operating_points)
    assert "older confidence definition" in caplog.text
    meta["confidence"] = {"answer": "min", "stream": "mean of the first 32"}
    meta_path.write_text(json.dumps(meta))
    assert RouterArtifact.load(tmp_path).operating_points[0].tau == -0.2
