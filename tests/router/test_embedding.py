"""The embedding service: the ONNX graph computes what the PyTorch model computes, padding and
batching do not change a text's vector, and concurrent async callers share forward passes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from router.embedding import DIM, MAX_BATCH, Embedder, minilm_dir

TEXTS = ["How do I learn Python quickly?", "What is the capital of France?", "ok"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Embedder:
    return Embedder.load(tmp_path_factory.mktemp("models"))


def test_vectors_are_unit_length_and_match_the_pytorch_model(embedder: Embedder) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel

    bert = BertModel.from_pretrained(minilm_dir()).eval()
    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    expected = []
    for text in TEXTS:
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.no_grad():
            hidden = bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        expected.append(torch.nn.functional.normalize(hidden.mean(1), dim=-1)[0].numpy())
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (3, DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, np.stack(expected), atol=1e-4)


def test_a_text_gets_the_same_vector_alone_or_padded_in_a_batch(embedder: Embedder) -> None:
    alone = np.stack([embedder.embed([text])[0] for text in TEXTS])
    np.testing.assert_allclose(embedder.embed(TEXTS), alone, atol=1e-5)


def test_a_long_list_is_embedded_in_bounded_batches_and_keeps_its_order(embedder: Embedder) -> None:
    texts = [f"question {i}: " + "why " * (i % 17) for i in range(MAX_BATCH * 2 + 5)]
    widths: list[int] = []
    run = embedder._run

    def counting(encodings: list) -> np.ndarray:
        widths.append(len(encodings))
        return run(encodings)

    embedder._run = counting  # type: ignore[method-assign]
    try:
        together = embedder.embed(texts)
    finally:
        del embedder._run
    assert max(widths) == MAX_BATCH and sum(widths) == len(texts)
    np.testing.assert_allclose(together, np.stack([embedder.embed([t])[0] for t in texts]), atol=1e-5)


def test_paraphrases_are_closer_than_unrelated_questions(embedder: Embedder) -> None:
    a, b, c = embedder.embed(
        ["How can I learn Python fast?", "What's the quickest way to learn Python?", "Best pizza in Rome"]
    )
    assert a @ b > 0.8 > a @ c


def test_concurrent_async_callers_are_batched_and_each_gets_its_own_rows(embedder: Embedder) -> None:
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
    assert sum(calls) == 12 and len(calls) < 12  # fewer forward passes than callers
    for text, vector in zip(TEXTS * 4, results, strict=True):
        np.testing.assert_allclose(vector[0], embed([text])[0], atol=1e-5)


def test_the_export_is_reused_and_named_by_the_weights(tmp_path: Path, embedder: Embedder) -> None:
    first = Embedder.load(tmp_path)
    exported = list(tmp_path.glob("*.onnx"))
    assert len(exported) == 1 and first.version.split("@")[1] in exported[0].name
    mtime = exported[0].stat().st_mtime_ns
    second = Embedder.load(tmp_path)
    assert exported[0].stat().st_mtime_ns == mtime and second.version == first.version == embedder.version
