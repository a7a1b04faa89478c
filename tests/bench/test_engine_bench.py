"""The engine benchmark runs the shipped tier spec, probes HF's batch size, and reports both ratios.

The end-to-end run uses a tiny random checkpoint (seconds, no demo model) and writes its JSON to a
temporary directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import bench.common
import bench.engine as engine_bench
from engines.tiers import demo_spec
from tests.tiny_models import write_tiny_checkpoint

# The keys every run wrote before the same-precision ratio existed: other tools read them.
EXISTING_KEYS = {
    "model", "model_path", "settings", "workload", "sluice_engine", "hf_transformers_generate", "ours_vs_hf",
    "cached_prefix_ttft", "batch1_decode", "quality_vs_float32", "targets",
}  # fmt: skip
EXISTING_SETTINGS = {
    "dtype", "quantization", "kv_cache_dtype", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens",
    "hf_batch_size", "hf_setting", "hf_probe_s", "threads", "hf_attention",
}  # fmt: skip
EXISTING_TARGETS = {
    "throughput_at_least_3x_hf", "ttft_p99_no_worse_than_hf", "kv_waste_below_4_pct",
    "cached_prefix_ttft_at_least_5x_sooner", "batch1_decode_at_least_60_pct_of_roofline",
}  # fmt: skip


def flags(model: str, **set_flags: object) -> argparse.Namespace:
    """The benchmark's parsed flags as `shipped_spec` reads them: every engine flag unset unless given."""
    return argparse.Namespace(model=model, **{flag: None for flag in engine_bench.ENGINE_FLAGS} | set_flags)


def test_the_engine_runs_the_small_tier_spec_that_make_run_serves() -> None:
    assert engine_bench.shipped_spec(flags("small")) == demo_spec("small")


def test_an_engine_flag_overrides_only_its_own_field() -> None:
    spec = engine_bench.shipped_spec(flags("small", max_num_seqs=64, quantization="none"))
    shipped = demo_spec("small")
    assert shipped is not None
    assert (spec.max_num_seqs, spec.quantization) == (64, None)
    assert (spec.kv_cache_mb, spec.kv_cache_dtype, spec.dtype) == (
        shipped.kv_cache_mb, shipped.kv_cache_dtype, shipped.dtype)  # fmt: skip


def test_the_probe_picks_the_most_output_tokens_per_second_overall_and_in_float32() -> None:
    probe = [
        {"setting": "float32-dynamic", "batch_size": 8, "output_tokens_per_s": 10.0},
        {"setting": "float32-dynamic", "batch_size": 16, "output_tokens_per_s": 14.0},
        {"setting": "float32-static", "batch_size": 32, "output_tokens_per_s": 13.0},
        {"setting": "bfloat16-dynamic", "batch_size": 32, "output_tokens_per_s": 20.0},
    ]
    best, best_float32 = engine_bench.fastest(probe), engine_bench.fastest(probe, torch.float32)
    assert (best, best_float32) == (("bfloat16-dynamic", 32), ("float32-dynamic", 16))
    assert engine_bench.hf_runs_planned(best, best_float32) == [best, best_float32]
    assert engine_bench.hf_runs_planned(best_float32, best_float32) == [best_float32]  # float32 won: one HF run


def test_batch_sizes_beyond_the_workload_are_not_probed() -> None:
    assert engine_bench.hf_batch_sizes(64) == [8, 16, 32]
    assert engine_bench.hf_batch_sizes(16) == [8, 16]
    assert engine_bench.hf_batch_sizes(4) == [8]


def run_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> dict[str, Any]:
    """`--quick` on a tiny random checkpoint, shrunk further to take seconds; its JSON results."""
    model = write_tiny_checkpoint(tmp_path / "model", "qwen2")
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(engine_bench, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(engine_bench, "QUALITY_TOKENS", 256)
    monkeypatch.setattr(engine_bench, "QUALITY_CHUNK_TOKENS", 128)  # the tiny model has 512 positions
    monkeypatch.setattr(engine_bench, "SYSTEM_PROMPT_TOKENS", 200)
    monkeypatch.setattr(engine_bench, "HF_PROBE_NEW_TOKENS", 2)
    engine_bench.main([
        "--model", str(model), "--quick", "--requests", "10", "--output-tokens", "4", "--rate", "1000",
        "--threads", "1", "--kv-cache-mb", "8", "--batch1-tokens", "8", *flags,
    ])  # fmt: skip
    return json.loads((tmp_path / "results" / "engine.json").read_text())


@pytest.mark.parametrize("hf_setting", ["auto", "bfloat16-dynamic"])
def test_a_run_reports_the_probe_and_both_ratios_beside_every_existing_key(
    hf_setting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = run_quick(tmp_path, monkeypatch, "--hf-setting", hf_setting)
    assert results.keys() >= EXISTING_KEYS
    assert results["settings"].keys() >= EXISTING_SETTINGS
    assert EXISTING_TARGETS | {"same_precision_at_least_2x", "full_stack_at_least_5x_within_1pct_perplexity"} <= (
        results["targets"].keys())  # fmt: skip
    probe = results["hf_probe"]
    # Every setting at batch 8 (the workload fills no larger batch); bfloat16 alone is probed beside float32.
    assert {(row["setting"], row["batch_size"]) for row in probe} == {(s, 8) for s in engine_bench.HF_SETTINGS}
    if hf_setting != "auto":
        assert results["settings"]["hf_setting"] == hf_setting
    assert results["settings"]["hf_probe_s"] == {row["setting"]: row["seconds"] for row in probe}
    assert results["hf_best_batch_size"] == results["settings"]["hf_batch_size"] == 8
    assert results["settings"]["engine_spec_overrides"] == {"kv_cache_mb": 8}

    same = results["same_precision"]
    assert same["sluice_engine_config"]["num_kv_blocks"] == results["sluice_engine"]["kv_blocks_total"]
    assert same["sluice_engine_float32"]["output_tokens"] == 10 * 4
    assert engine_bench.HF_SETTINGS[same["hf_setting"]][0] == torch.float32
    hf_float32 = same["hf_transformers_generate_float32"]
    # HF in float32 ran a second time only when the fastest setting was not float32.
    assert (hf_float32 == results["hf_transformers_generate"]) == (
        same["hf_setting"] == results["settings"]["hf_setting"]
    )
    assert results["same_precision_throughput_ratio"] == pytest.approx(
        same["sluice_engine_float32"]["output_tokens_per_s"] / hf_float32["output_tokens_per_s"])  # fmt: skip
    assert results["ours_vs_hf"]["same_precision_throughput_ratio"] == results["same_precision_throughput_ratio"]
    assert results["ours_vs_hf"]["throughput_ours_over_hf_x"] == pytest.approx(
        results["sluice_engine"]["output_tokens_per_s"] / results["hf_transformers_generate"]["output_tokens_per_s"]
    )
    # Quality on the decode path: greedy GSM8K answers against float32, when the data is there (else None).
    decode_quality = results["decode_quality_vs_float32"]
    if (engine_bench.GSM8K_DIR / "test.jsonl").is_file():
        assert decode_quality["answers"] == engine_bench.DECODE_QUALITY_QUESTIONS
        assert 0 <= decode_quality["token_agreement_pct"] <= 100
        assert 1 <= decode_quality["max_tokens"] <= engine_bench.DECODE_QUALITY_TOKENS
    else:
        assert decode_quality is None


def test_without_hf_our_engine_still_runs_in_both_precisions_and_no_ratio_is_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = run_quick(tmp_path, monkeypatch, "--skip-hf")
    assert results.keys() >= EXISTING_KEYS
    assert results["hf_transformers_generate"] is None and results["ours_vs_hf"] == {} and results["hf_probe"] == []
    assert results["same_precision"]["sluice_engine_float32"]["output_tokens"] == 10 * 4
    assert results["same_precision_throughput_ratio"] is None
    assert not results["targets"]["same_precision_at_least_2x"]
    assert not results["targets"]["full_stack_at_least_5x_within_1pct_perplexity"]
