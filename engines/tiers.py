"""What one tier serves and how: a model plus the engine settings that fit it.

A `TierSpec` is the launcher's view (demo model names, megabytes of KV cache); `engine_config()`
turns it into the engine library's plain `EngineConfig`, resolving demo names to files. The demo
tiers' specs (`engines/small/spec.py`, `engines/large/spec.py`) are where their engine defaults are
defined; the gateway's configuration overrides them field by field (`tier_spec`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass

from engines.config import EngineConfig
from engines.registry import resolve_model


@dataclass(frozen=True)
class TierSpec:
    name: str  # the tier, and the model name the tier serves unless `served_model_name` says otherwise
    model: str  # a demo model name (tiny|small|large) or a GGUF file / safetensors directory
    device: str = "cpu"  # "cpu" | "cuda[:N]"
    dtype: str = "float32"
    quantization: str | None = "auto"  # None | "auto" | "w8a8" | "int8" | "int4" | "fp8" (engines.quantization)
    kv_cache_dtype: str | None = "auto"  # None: dtype; "auto": bfloat16 on CPUs with native bf16
    w8a8_attention_passes: int = 2  # int8 passes over the attention projections' inputs under w8a8 (EngineConfig)
    kv_cache_mb: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_batch_tokens_beside_interactive: int = 1  # batch-priority tokens a step takes beside interactive decodes
    max_model_len: int = 4096
    # Speculative decoding: a drafter sharing the tokenizer (demo model name or path) proposing up to
    # `num_speculative_tokens` tokens per decode step (engines.speculative); None: off.
    speculative_draft: str | None = None
    num_speculative_tokens: int = 6
    served_model_name: str | None = None
    num_threads: int | None = None
    batch_invariant: bool = False  # a request's bits whatever its batch, chunking or cache (EngineConfig)

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name

    def replace(self, **overrides: object) -> TierSpec:
        """This spec with the given fields changed; `None` values are ignored (unset CLI flags)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def engine_config(self, cache_dir: str | os.PathLike[str] | None = None) -> EngineConfig:
        """The engine's configuration; raises FileNotFoundError when a demo model is not fetched."""
        return EngineConfig(
            model=str(resolve_model(self.model, cache_dir)),
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            w8a8_attention_passes=self.w8a8_attention_passes,
            kv_cache_bytes=self.kv_cache_mb << 20,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_batch_tokens_beside_interactive=self.max_batch_tokens_beside_interactive,
            max_model_len=self.max_model_len,
            num_threads=self.num_threads,
            batch_invariant=self.batch_invariant,
            served_model_name=self.served_name,
            speculative_model=str(resolve_model(self.speculative_draft, cache_dir)) if self.speculative_draft
            else None,
            num_speculative_tokens=self.num_speculative_tokens,
        )


DEMO_TIERS = ("small", "large")


def demo_spec(name: str) -> TierSpec | None:
    """The spec of a demo tier (`engines/<name>/spec.py`); None for other names."""
    if name not in DEMO_TIERS:
        return None
    return importlib.import_module(f"engines.{name}.spec").SPEC


def tier_spec(name: str, model: str, **overrides: object) -> TierSpec:
    """The tier `name`: its demo spec (or the `TierSpec` defaults) with `overrides` that are not None.
    `quantization="none"` turns quantisation off, `speculative_draft=""` speculative decoding."""
    base = demo_spec(name) or TierSpec(name=name, model=model)
    spec = base.replace(model=model or None, **overrides)
    if spec.quantization == "none":
        spec = dataclasses.replace(spec, quantization=None)
    return dataclasses.replace(spec, speculative_draft=None) if spec.speculative_draft == "" else spec
