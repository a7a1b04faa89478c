"""The shipped classifier loads, holds no prompt text, stays small and scores a batch."""

import numpy as np

from router.artifact import DEFAULT_ARTIFACT_DIR, RouterArtifact


def test_the_shipped_default_loads_and_scores() -> None:
    artifact = RouterArtifact.load(DEFAULT_ARTIFACT_DIR)
    assert artifact.meta["training_data"]["rows"] > 1000
    assert 0.0 < artifact.operating_point().threshold < 1.0
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(3, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = artifact.score(vectors, ["What is 2 + 2?", "Explain entropy.", "A. one\nB. two\nAnswer:"])
    assert scores.shape == (3,) and ((scores >= 0) & (scores <= 1)).all()


def test_the_shipped_default_is_small_and_has_no_prompt_text() -> None:
    files = [p for p in DEFAULT_ARTIFACT_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 5 * 2**20
    meta = (RouterArtifact.load(DEFAULT_ARTIFACT_DIR).path / "meta.json").read_text()
    assert "Janet" not in meta and "Answer:" not in meta


def test_the_shipped_default_was_trained_on_the_embeddings_a_cpu_gateway_computes() -> None:
    from router.embedding import Embedder

    trained_on = RouterArtifact.load(DEFAULT_ARTIFACT_DIR).meta["features"]["embedder"]
    assert trained_on == Embedder.load(precision="int8").version  # else: `make router-default`
