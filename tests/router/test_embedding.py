"""The embedding service: the ONNX graphs compute what the PyTorch model computes (the int8 one within
quantisation error), a text's vector does not depend on what it is embedded beside, and concurrent async
callers share calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from router.embedding import DIM, MAX_BATCH, Embedder, default_precision, minilm_dir

TEXTS = ["How do I learn Python quickly?", "What is the capital of France?", "ok"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def embedder(models_dir: Path) -> Embedder:
    """What a gateway on this machine loads: int8 on a CPU."""
    return Embedder.load(models_dir)


@pytest.fixture(scope="module")
def float_embedder(models_dir: Path) -> Embedder:
    return Embedder.load(models_dir, precision="float32")


def pytorch_vectors(texts: list[str]) -> np.ndarray:
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel

    bert = BertModel.from_pretrained(minilm_dir()).eval()
    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    expected = []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.no_grad():
            hidden = bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        expected.append(torch.nn.functional.normalize(hidden.mean(1), dim=-1)[0].numpy())
    return np.stack(expected)


def test_a_cpu_gets_the_int8_graph_and_a_cuda_provider_the_float_one(embedder: Embedder) -> None:
    assert default_precision(["CPUExecutionProvider"]) == "int8"
    assert default_precision(["CUDAExecutionProvider", "CPUExecutionProvider"]) == "float32"
    assert embedder.precision == "int8" and embedder.version.endswith("-int8")
    with pytest.raises(ValueError, match="precision"):
        Embedder.load(precision="int4")


def test_the_float_graph_matches_the_pytorch_model(float_embedder: Embedder) -> None:
    vectors = float_embedder.embed(TEXTS)
    assert vectors.shape == (3, DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, pytorch_vectors(TEXTS), atol=1e-4)


def test_the_int8_graph_stays_within_quantisation_error_of_the_pytorch_model(embedder: Embedder) -> None:
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (3, DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = (vectors * pytorch_vectors(TEXTS)).sum(axis=1)
    # A one-word text ("ok": three tokens with [CLS] and [SEP]) averages the least quantisation noise away:
    # above 0.97 on one Zen 3 VM (CI of 2026-12-04 evening), 0.9695 on another with the same pinned onnxruntime.
    assert cosines[:2].min() > 0.99 and cosines.min() > 0.96, cosines
    assert not np.allclose(vectors, pytorch_vectors(TEXTS), atol=1e-4)  # it is the quantised graph


def test_an_int8_vector_is_the_same_bits_whatever_it_is_embedded_beside(embedder: Embedder) -> None:
    # The int8 graph scales its activations per call: batched with a longer text, a vector would change.
    longer = "What is the capital of France, and how many people lived there a hundred years ago?"
    for text in TEXTS:
        alone = embedder.embed([text])[0]
        assert np.array_equal(embedder.embed([longer, text, "ok"])[1], alone)


def test_an_int8_vector_is_the_same_bits_on_one_thread_or_two(models_dir: Path, embedder: Embedder) -> None:
    # The version names the vectors, not the threads that computed them.
    one_thread = Embedder.load(models_dir, threads=1)
    long_text = " ".join(f"item {i} of a long list" for i in range(40))
    for text in [*TEXTS, long_text]:
        assert np.array_equal(one_thread.embed([text]), embedder.embed([text]))
    assert one_thread.version == embedder.version


def test_a_float_vector_is_the_same_alone_or_padded_in_a_batch(float_embedder: Embedder) -> None:
    alone = np.stack([float_embedder.embed([text])[0] for text in TEXTS])
    np.testing.assert_allclose(float_embedder.embed(TEXTS), alone, atol=1e-5)


@pytest.mark.parametrize(("precision", "widest_call"), [("float32", MAX_BATCH), ("int8", 1)])
def test_a_long_list_keeps_its_order_in_bounded_calls(
    precision: str, widest_call: int, embedder: Embedder, float_embedder: Embedder
) -> None:
    model = float_embedder if precision == "float32" else embedder
    texts = [f"question {i}: " + "why " * (i % 17) for i in range(MAX_BATCH * 2 + 5)]
    widths: list[int] = []
    run = model._run

    def counting(encodings: list) -> np.ndarray:
        widths.append(len(encodings))
        return run(encodings)

    model._run = counting  # type: ignore[method-assign]
    try:
        together = model.embed(texts)
    finally:
        del model._run
    assert max(widths) == widest_call and sum(widths) == len(texts)
    np.testing.assert_allclose(together, np.stack([model.embed([t])[0] for t in texts]), atol=1e-5)


def test_paraphrases_are_closer_than_unrelated_questions(embedder: Embedder) -> None:
    a, b, c = embedder.embed(
        ["How can I learn Python fast?", "What's the quickest way to learn Python?", "Best pizza in Rome"]
    )
    assert a @ b > 0.8 > a @ c


def test_concurrent_async_callers_share_calls_and_each_gets_its_own_rows(embedder: Embedder) -> None:
    calls: list[int] = []
    embed = embedder.embed

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        return embed(texts)

    embedder.embed = counting  # type: ignore[method-assign]
    try:

        async def burst() -> list[np.ndarray]:
            return await asyncio.gather(*(embedder.embed_async([text]) for text in TEXTS * 4))

        results = asyncio.run(burst())
    finally:
        del embedder.embed
    assert sum(calls) == 12 and len(calls) < 12  # fewer hops off the event loop than callers
    for text, vector in zip(TEXTS * 4, results, strict=True):
        np.testing.assert_array_equal(vector[0], embed([text])[0])


def test_the_export_is_reused_and_named_by_the_weights_and_precision(tmp_path: Path, embedder: Embedder) -> None:
    first = Embedder.load(tmp_path)
    exported = list(tmp_path.glob("*.onnx"))
    assert len(exported) == 1 and first.version.split("@")[1] in exported[0].name
    assert exported[0].name.endswith("-int8.onnx")
    mtime = exported[0].stat().st_mtime_ns
    second = Embedder.load(tmp_path)
    assert exported[0].stat().st_mtime_ns == mtime and second.version == first.version == embedder.version


def test_texts_cut_shorter_for_an_experiment_are_named_apart_from_the_served_vectors(models_dir: Path,
                                                                                      embedder: Embedder) -> None:
    cut = Embedder.load(models_dir, max_tokens=8)
    long = "one two three four five six seven eight nine ten eleven twelve"
    assert cut.version == f"{embedder.version}-max8"
    assert cut.count_tokens([long]) == 8 < embedder.count_tokens([long])
    assert np.array_equal(cut.embed([long]), embedder.embed(["one two three four five six"]))  # + [CLS], [SEP]
    with pytest.raises(ValueError, match="max_tokens"):
        Embedder.load(models_dir, max_tokens=512)


def test_a_gateway_runs_numpy_products_on_one_thread_beside_the_embedder() -> None:
    """OpenBLAS's idle workers spin after each product and slowed the next embedding (BENCHMARKS.md, router (c)).
    In a fresh process: this one's BLAS pools have been set by earlier tests, and OpenBLAS may not go back up."""
    import json
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: numpy's BLAS runs on one thread anyway")
    script = """
import json
from threadpoolctl import threadpool_info
from gateway.config import load_settings
from gateway.routing import build_router
def blas_threads():
    return sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
before = blas_threads()
router = build_router(load_settings(environ={}))
print(json.dumps([before, blas_threads(), router.embedder is not None]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    before, after, embedder_loaded = json.loads(result.stdout.splitlines()[-1])
    assert before != [1] and after == [1] and embedder_loaded
