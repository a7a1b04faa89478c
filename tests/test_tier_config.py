"""One tier configuration: a tier gets the same engine in the gateway's process and under
`sluice engine --tier`, from the same TOML and `SLUICE_*` overrides, with the demo tier's spec
holding every default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines import server
from engines.large.spec import SPEC as LARGE
from engines.small.spec import SPEC as SMALL
from engines.tiers import TierSpec
from gateway import cli
from gateway.assembly import engine_spec
from gateway.config import load_settings


def test_unset_engine_settings_are_the_demo_tiers_specs() -> None:
    settings = load_settings(environ={})
    assert engine_spec("small", settings.tiers["small"]) == SMALL
    assert engine_spec("large", settings.tiers["large"]) == LARGE
    assert LARGE.kv_cache_mb == 1024  # the large tier's KV cache, in-process as under `sluice engine`


def test_configured_engine_settings_override_the_spec_field_by_field(tmp_path: Path) -> None:
    file = tmp_path / "s.toml"
    file.write_text('[tiers.small]\n[tiers.large]\nkv_cache_mb = 256\nquantization = "none"\n')
    settings = load_settings(file, environ={"SLUICE_TIERS__LARGE__MAX_NUM_SEQS": "4",
                                            "SLUICE_TIERS__LARGE__W8A8_ATTENTION_PASSES": "1",
                                            "SLUICE_TIERS__LARGE__BATCH_INVARIANT": "true"})
    spec = engine_spec("large", settings.tiers["large"])
    assert (spec.kv_cache_mb, spec.max_num_seqs, spec.quantization) == (256, 4, None)
    assert (spec.w8a8_attention_passes, SMALL.w8a8_attention_passes) == (1, 2)
    assert spec.engine_config().w8a8_attention_passes == 1
    assert (spec.engine_config().batch_invariant, SMALL.engine_config().batch_invariant) == (True, False)
    assert (spec.max_model_len, spec.kv_cache_dtype, spec.model) == (LARGE.max_model_len, LARGE.kv_cache_dtype, "large")


def test_a_tier_that_is_not_a_demo_tier_starts_from_the_tier_spec_defaults(tmp_path: Path) -> None:
    file = tmp_path / "s.toml"
    file.write_text(
        '[tiers.tiny]\nmodel = "tiny"\nmax_model_len = 2048\n[server]\ndefault_tier = "tiny"\n'
        '[policies.default]\nallowed_tiers = ["tiny"]\n'
    )
    settings = load_settings(file, environ={})
    spec = engine_spec("tiny", settings.tiers["tiny"])
    assert spec == TierSpec(name="tiny", model="tiny", max_model_len=2048)


def test_sluice_engine_serves_the_tier_as_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    served: list[tuple[TierSpec, str | None]] = []
    monkeypatch.setattr(server, "run_engine_server", lambda spec, **kw: served.append((spec, kw.get("cache_dir"))))
    for name in [n for n in os.environ if n.startswith("SLUICE_")]:  # the test run's own settings
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLUICE_TIERS__LARGE__KV_CACHE_MB", "768")
    monkeypatch.setenv("SLUICE_MODELS__CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no ./sluice.toml
    assert cli.main(["engine", "--tier", "large", "--port", "8123"]) == 0
    ((spec, cache_dir),) = served
    assert (spec.name, spec.kv_cache_mb, spec.max_num_seqs) == ("large", 768, LARGE.max_num_seqs)
    assert cache_dir == str(tmp_path)
    assert cli.main(["engine", "--tier", "medium"]) == 2  # not configured
