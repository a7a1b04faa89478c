"""The tiers the gateway can call, and which to try when one is down.

A tier that is down or times out (`EngineUnavailable`) is replaced by the other tiers the key may
use, in configuration order, when its policy allows fallback; when none can serve, the request
gets a 503 with `Retry-After`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from engines.client import EngineClient, EngineUnavailable
from gateway.config import PolicyConfig, Settings, TierConfig
from gateway.errors import GatewayError, service_unavailable

_T = TypeVar("_T")


def candidate_tiers(primary: str, policy: PolicyConfig, tiers: Mapping[str, object]) -> list[str]:
    """The tiers to try, in order: the chosen one, then (if fallback is allowed) the other allowed tiers."""
    if not policy.fallback:
        return [primary]
    return [primary, *(t for t in tiers if t != primary and t in policy.allowed_tiers)]


def unavailable(tried: list[str]) -> GatewayError:
    return service_unavailable(
        f"No tier could serve the request (tried {', '.join(tried)}). Retry later.", "tier_unavailable"
    )


@dataclass(frozen=True, slots=True)
class Served(Generic[_T]):
    tier: str
    fallback: bool
    value: _T


async def call_with_fallback(
    clients: Mapping[str, EngineClient], candidates: list[str], call: Callable[[str, EngineClient], Awaitable[_T]]
) -> Served[_T]:
    for tier in candidates:
        try:
            return Served(tier, tier != candidates[0], await call(tier, clients[tier]))
        except EngineUnavailable:
            continue
    raise unavailable(candidates)


async def open_stream_with_fallback(
    clients: Mapping[str, EngineClient], candidates: list[str], open_stream: Callable[[EngineClient], AsyncIterator[_T]]
) -> Served[tuple[_T, AsyncIterator[_T]]]:
    """Start a stream and wait for its first chunk, so that a tier failing before it produced
    anything can still be replaced. Returns the first chunk and the rest of the stream."""
    for tier in candidates:
        stream = open_stream(clients[tier])
        try:
            first = await anext(stream)
        except EngineUnavailable:
            await _close(stream)
            continue
        except BaseException:
            await _close(stream)
            raise
        return Served(tier, tier != candidates[0], (first, stream))
    raise unavailable(candidates)


async def _close(stream: AsyncIterator[object]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def build_client(name: str, tier: TierConfig, settings: Settings) -> EngineClient:
    """The client for one configured tier: an upstream over HTTP when `url` is set, else an engine
    in this process. Slow (loads a tokenizer or a whole model): call it off the event loop."""
    from engines.client import HttpEngineClient, build_in_process_client
    from engines.loader import load_tokenizer
    from engines.registry import resolve_model
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
