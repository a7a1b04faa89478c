"""Neighbour smoothing: a prompt scores the share of its nearest training prompts that needed the large tier."""

import numpy as np

from router.neighbours import NeighbourIndex


def _clusters() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centres = np.eye(384, dtype=np.float32)[:2] * 5
    points = np.vstack([centres[0] + rng.normal(size=(50, 384)), centres[1] + rng.normal(size=(50, 384))])
    labels = np.array([1.0] * 40 + [0.0] * 10 + [0.0] * 50)  # cluster 0: 80% hard; cluster 1: none
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32), labels


def test_a_prompt_gets_its_topics_rate() -> None:
    points, labels = _clusters()
    index = NeighbourIndex.fit(points, labels, k=20, dims=8)
    scores = index.score(points[[0, 99]])
    assert scores[0] > 0.6 and scores[1] < 0.1


def test_excluding_self_drops_each_querys_own_label() -> None:
    points, labels = _clusters()
    index = NeighbourIndex.fit(points, labels, k=1, dims=16)
    assert index.score(points[:1]).tolist() == [labels[0]]  # its own entry is its nearest
    assert index.score(points[:1], exclude_self=True)[0] in (0.0, 1.0)


def test_round_trips_through_bytes(tmp_path) -> None:
    points, labels = _clusters()
    index = NeighbourIndex.fit(points, labels, k=10, dims=8)
    (tmp_path / "neighbours.npz").write_bytes(index.to_bytes())
    again = NeighbourIndex.load(tmp_path)
    assert again.k == 10
    assert np.allclose(again.score(points[:5]), index.score(points[:5]))
