"""Where tier clients are built: the one gateway module that constructs engines (the app factory
and the CLI call it; the request path sees only `engines.api.client.EngineClient`)."""

from __future__ import annotations

from engines.api.client import EngineClient, HttpEngineClient
from gateway.config import Settings, TierConfig


def build_client(name: str, tier: TierConfig, settings: Settings) -> EngineClient:
    """The client for one configured tier: an upstream over HTTP when `url` is set, else an engine
    in this process. Slow (loads a tokenizer or a whole model): call it off the event loop."""
    from engines.loader import load_tokenizer
    from engines.registry import resolve_model
    from engines.serving import build_in_process_client
    from engines.tiers import TierSpec

    cache_dir = str(settings.models_cache_dir)
    if tier.url:
        # `model` is not read for an upstream tier: only `tokenizer` makes budgets exact; without it
        # the client estimates prompt tokens.
        return HttpEngineClient(
            tier.url,
            tier.upstream_model or name,
            api_key=tier.api_key,
            tokenizer=load_tokenizer(resolve_model(tier.tokenizer, cache_dir)) if tier.tokenizer else None,
            connect_timeout=tier.connect_timeout_s,
            read_timeout=tier.read_timeout_s,
        )
    spec = TierSpec(
        name=name,
        model=tier.model,
        dtype=tier.dtype,
        quantization=None if tier.quantization == "none" else tier.quantization,
        kv_cache_dtype=tier.kv_cache_dtype,
        kv_cache_mb=tier.kv_cache_mb,
        max_num_seqs=tier.max_num_seqs,
        max_num_batched_tokens=tier.max_num_batched_tokens,
        max_model_len=tier.max_model_len,
        speculative_drafter=tier.speculative_draft or None,
        num_speculative_tokens=tier.num_speculative_tokens,
    )
    return build_in_process_client(spec, cache_dir=cache_dir)
