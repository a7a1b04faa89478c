"""Where tier clients are built: the one gateway module that constructs engines (the app factory
and the CLI call it; the request path sees only `engines.api.client.EngineClient`)."""

from __future__ import annotations

from engines.api.client import EngineClient, HttpEngineClient
from engines.tiers import TierSpec, tier_spec
from gateway.config import Settings, TierConfig

# The keys of a tier's configuration that are engine settings (`engines.tiers.TierSpec` fields).
ENGINE_FIELDS = (
    "device",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "w8a8_attention_passes",
    "kv_cache_mb",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_batch_tokens_beside_interactive",
    "max_model_len",
    "num_threads",
    "batch_invariant",
    "speculative_draft",
    "num_speculative_tokens",
)


def build_client(name: str, tier: TierConfig, settings: Settings) -> EngineClient:
    """The client for one configured tier: an upstream over HTTP when `url` is set, else an engine
    in this process. Slow (loads a tokenizer or a whole model): call it off the event loop."""
    from engines.loader import load_tokenizer
    from engines.registry import resolve_model
    from engines.serving import build_in_process_client

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
            pool_timeout=tier.pool_timeout_s,
            request_timeout=tier.request_timeout_s,
            priority_field=tier.upstream_priority,
        )
    return build_in_process_client(engine_spec(name, tier), cache_dir=cache_dir, deadline_s=tier.request_timeout_s)


def engine_spec(name: str, tier: TierConfig) -> TierSpec:
    """The engine spec of a configured tier: in-process, or served by `sluice engine --tier <name>`."""
    fields = {f: getattr(tier, f) for f in ENGINE_FIELDS}
    return tier_spec(name, tier.model, **fields)
