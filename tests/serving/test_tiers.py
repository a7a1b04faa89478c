"""Tier specs: what each tier serves, overrides from the launcher, and the engine config they make."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.large.spec import SPEC as LARGE
from engines.small.spec import SPEC as SMALL
from engines.tiers import TierSpec


def test_the_demo_tiers_serve_the_qwen_coder_models_with_float32_activations_and_precision_for_the_cpu() -> None:
    assert (SMALL.name, SMALL.model, SMALL.served_name) == ("small", "small", "small")
    assert (LARGE.name, LARGE.model, LARGE.served_name) == ("large", "large", "large")
    for spec in (SMALL, LARGE):
        assert (spec.dtype, spec.quantization, spec.kv_cache_dtype) == ("float32", "auto", "auto")


def test_overrides_replace_only_the_fields_given() -> None:
    changed = SMALL.replace(model="/models/x.gguf", max_num_seqs=4, dtype=None)
    assert (changed.model, changed.max_num_seqs, changed.dtype) == ("/models/x.gguf", 4, SMALL.dtype)
    assert SMALL.max_num_seqs != 4  # specs are values


def test_engine_config_resolves_a_path_and_carries_the_settings(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    spec = TierSpec(name="t", model=str(model), kv_cache_mb=64, max_num_seqs=3, max_model_len=1024,
                    served_model_name="served")  # fmt: skip
    config = spec.engine_config()
    assert config.model == str(model)
    assert (config.kv_cache_bytes, config.max_num_seqs, config.max_model_len) == (64 << 20, 3, 1024)
    assert (config.quantization, config.dtype, config.served_model_name) == ("auto", "float32", "served")
    assert config.kv_cache_dtype == "auto"


def test_an_unfetched_demo_model_tells_the_user_how_to_fetch_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="sluice models fetch small"):
        SMALL.engine_config(cache_dir=tmp_path)
