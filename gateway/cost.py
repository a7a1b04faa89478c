"""The one cost model: what a request costs in USD at its tier's per-million-token prices."""

from __future__ import annotations

from gateway.config import TierConfig

TOKENS_PER_PRICE_UNIT = 1_000_000


def request_cost(tier: TierConfig, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> float:
    """USD for one request. `cached_tokens` are the part of `prompt_tokens` served from the prefix
    cache: they are billed at the cached-input price, the rest of the prompt at the input price."""
    if prompt_tokens < 0 or completion_tokens < 0 or cached_tokens < 0:
        raise ValueError(
            f"token counts must be non-negative (prompt={prompt_tokens}, completion={completion_tokens}, "
            f"cached={cached_tokens})"
        )
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    uncached_tokens = prompt_tokens - cached_tokens
    return (
        uncached_tokens * tier.price_input_per_mtok
        + cached_tokens * tier.price_cached_input_per_mtok
        + completion_tokens * tier.price_output_per_mtok
    ) / TOKENS_PER_PRICE_UNIT
