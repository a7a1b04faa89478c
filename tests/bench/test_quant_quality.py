"""The quantisation-quality benchmark: its answer scoring on hand-made texts, and a whole run on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
import bench.engine
from bench.quant_quality import (
    FORMATS,
    batch_decode,
    check_data,
    format_config,
    generation_agreement,
    main,
    score_answers,
    token_agreement,
)
from engines.config import EngineConfig
from engines.llm_engine import LLMEngine
from engines.loader import Checkpoint, load_checkpoint
from tests.tiny_models import write_tiny_checkpoint

QUESTIONS = [
    ("The cache has 3 blocks and frees 1. How many are left?", "3 - 1 = 2\n#### 2"),
    ("A request has 4 tokens and 5 more come. How many tokens?", "4 + 5 = 9\n#### 9"),
    ("Two models answer 6 questions each. How many answers?", "2 * 6 = 12\n#### 12"),
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("quant-quality-tiny"), "qwen2")


@pytest.fixture(scope="module")
def checkpoint(tiny_path: Path) -> Checkpoint:
    return load_checkpoint(tiny_path)


@pytest.fixture
def gsm8k(tmp_path: Path) -> Path:
    for split in ("train", "test"):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in QUESTIONS]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def tiny_config(**overrides: object) -> EngineConfig:
    settings: dict[str, object] = dict(model="tiny", num_kv_blocks=128, block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=64, num_threads=1)  # fmt: skip
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


def prompts(checkpoint: Checkpoint) -> list[list[int]]:
    return [checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in QUESTIONS]


def test_answers_are_scored_against_the_reference_and_the_gold_answer():
    reference = ["#### 3", "The answer is 5", "no number here", "#### 7"]
    answers = ["so 3", "#### 6", "#### 2", "nothing"]
    scored = score_answers(reference, answers, gold=[3, 5, 2, 7])
    assert scored["answers"] == 4
    assert scored["final_answer_agreement_pct"] == 25.0  # only the first; a pair without a number disagrees
    assert scored["final_answer_pairs_without_number"] == 2
    assert scored["answers_without_number"] == 1
    assert scored["reference_answers_without_number"] == 1
    assert scored["final_answers_differing"] == [1, 2, 3]
    assert scored["accuracy_pct"] == 50.0
    assert scored["reference_accuracy_pct"] == 75.0
    assert "accuracy_pct" not in score_answers(reference, answers)


def test_token_agreement_is_the_share_before_the_first_difference():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([], []) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 9]) == 0.5
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5  # a shorter answer stops where the other goes on
    assert token_agreement([1], [2]) == 0.0


def test_formats_differ_only_in_precision():
    base = tiny_config(kv_cache_bytes=1 << 20)
    for name in FORMATS:
        config = format_config(base, name)
        assert (config.max_num_seqs, config.kv_cache_bytes, config.num_threads) == (4, 1 << 20, 1)
    assert format_config(base, "w8a8").quantization == "w8a8"
    passes = [format_config(base, name).w8a8_attention_passes for name in ("w8a8", "w8a8-one-pass")]
    assert passes == [2, 1]
    assert format_config(base, "bf16").kv_cache_dtype == "bfloat16"


def test_float32_agrees_with_itself_on_every_token(checkpoint: Checkpoint):
    config = format_config(tiny_config(), "float32")
    agreement = generation_agreement(checkpoint, config, prompts(checkpoint), max_tokens=8)
    assert agreement["answers"] == 3
    assert agreement["token_agreement_pct"] == 100.0
    assert agreement["token_identical_answers"] == 3
    assert agreement["answers_without_number"] == agreement["reference_answers_without_number"]


def test_quantised_generation_is_compared_with_a_given_reference(checkpoint: Checkpoint):
    reference = [[0] * 8 for _ in QUESTIONS]  # nothing the model writes starts like this
    config = format_config(tiny_config(), "int8")
    agreement = generation_agreement(checkpoint, config, prompts(checkpoint), 8, gold=[2, 9, 12], reference=reference)
    assert 0.0 <= agreement["token_agreement_pct"] < 100.0
    assert agreement["reference_answer_tokens_mean"] == 8
    assert 0.0 <= agreement["accuracy_pct"] <= 100.0


def test_batch_decode_times_every_request_at_once(checkpoint: Checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, tiny_config())
    figures = batch_decode(engine, prompts(checkpoint)[:2] * 2, steps=3)
    assert figures["batch"] == 4
    assert figures["decode_tokens_per_s"] > 0
    assert not engine.has_unfinished_requests()


def test_missing_data_exits_with_a_message(tmp_path: Path):
    with pytest.raises(SystemExit, match="GSM8K not found"):
        check_data(tmp_path / "nowhere")


def test_a_whole_run_on_a_tiny_model(tiny_path: Path, gsm8k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(bench.engine, "BANDWIDTH_BYTES", 1 << 20)  # the roofline beside batch-1 decode
    main(["--models", str(tiny_path), "--formats", "int8", "bf16", "--questions", "3", "--max-tokens", "6",
          "--ppl-tokens", "32", "--speed-tokens", "8", "--kv-cache-mb", "4", "--threads", "1",
          "--data", str(gsm8k)])  # fmt: skip
    written = json.loads((tmp_path / "results" / "quant_quality.json").read_text())
    rows = written["results"]
    assert [row["format"] for row in rows] == ["float32", "int8", "bf16"]  # float32, the reference, first
    float32 = rows[0]
    assert float32["perplexity_increase_pct"] == 0.0
    assert float32["top1_agreement_with_float32_pct"] == 100.0
    assert float32["generation_vs_float32"]["token_identical_answers"] == 3
    assert rows[1]["weight_gb"] < float32["weight_gb"] == rows[1]["weight_gb_float32"]
    assert rows[2]["precision"]["kv_cache_dtype"] == "bfloat16"
    assert all(row["batch16_decode"]["decode_tokens_per_s"] > 0 for row in rows)
