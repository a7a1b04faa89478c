"""Fallback: which tiers to try for a request, and trying them in turn when one is down.

A tier that is down or times out (`EngineUnavailable`) is replaced by the other tiers the key may
use, in configuration order, when its policy allows fallback; when none can serve, the request
gets a 503 with `Retry-After`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from engines.api.client import EngineClient, EngineUnavailable
from engines.api.errors import APIError, service_unavailable
from engines.api.sse import close
from gateway.config import PolicyConfig

_T = TypeVar("_T")


def candidate_tiers(primary: str, policy: PolicyConfig, tiers: Mapping[str, object]) -> list[str]:
    """The tiers to try, in order: the chosen one, then (if fallback is allowed) the other allowed tiers."""
    if not policy.fallback:
        return [primary]
    return [primary, *(t for t in tiers if t != primary and t in policy.allowed_tiers)]


def unavailable(tried: list[str]) -> APIError:
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
            await close(stream)
            continue
        except BaseException:
            await close(stream)
            raise
        return Served(tier, tier != candidates[0], (first, stream))
    raise unavailable(candidates)
