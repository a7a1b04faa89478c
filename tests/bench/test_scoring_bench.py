"""The scoring benchmark compares like with like: its transformers path (right-padded batches) scores each prompt as
our engine does in the same precision, and its agreement figures are what they say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.engine import hf_model
from bench.scoring import agreement, hf_scores, ours
from engines.config import EngineConfig
from engines.llm_engine import LLMEngine
from engines.loader import load_checkpoint
from tests.tiny_models import write_tiny_checkpoint


def test_padded_transformers_batches_score_each_prompt_as_our_float32_engine_does(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(write_tiny_checkpoint(tmp_path, "qwen2"))
    prompts = [[(5 * i + j) % 400 + 10 for i in range(length)] for j, length in enumerate((70, 23, 41))]
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(
        model="tiny", dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=64, num_threads=1))
    _, scored = ours(engine, prompts, scored=True, tag="t")
    _, reference = hf_scores(hf_model(checkpoint, torch.float32), prompts, batch=2)  # the second batch alone
    assert [len(s) for s in scored] == [len(s) for s in reference] == [len(p) - 1 for p in prompts]
    for ours_lp, hf_lp in zip(scored, reference, strict=True):
        assert ours_lp == pytest.approx(hf_lp, abs=1e-4)


def test_agreement_reports_the_per_token_shift_and_the_pairs_ranked_alike() -> None:
    figures = agreement([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0]], [[-1.5, -2.0], [-0.5, -0.3], [-1.0, -1.0]])
    assert figures["mean_abs_logprob_diff_per_token"] == pytest.approx((0.5 + 0 + 0 + 0.2 + 2.0 + 0) / 6)
    assert figures["max_abs_logprob_diff_per_token"] == pytest.approx(2.0)
    # Sums (ours, reference): (-3, -3.5), (-1, -0.8), (-4, -2). Prompts 1 and 3 rank one way by ours (-3 > -4) and
    # the other by the reference (-3.5 < -2); the other two pairs alike.
    assert figures["pairwise_ranking_agreement"] == pytest.approx(2 / 3)
