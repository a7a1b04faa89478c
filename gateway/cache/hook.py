"""The narrow hook between the request path and the response cache.

`CacheHook.begin` after admission: a hit becomes the reply (JSON, or SSE replayed from it); a miss
that may be kept is stored by `store` once its answer is complete, or ended by `release`. The
embedding of the last user message is computed once and left on the request state
(`prompt_embedding`), where the router reads it too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.cache.service import CachePolicy, Lookup, ResponseCache
from gateway.cache.store import CacheStore, MemoryCacheStore, RedisCacheStore
from gateway.cache.verifier import MATCHER_DIR, Matcher
from gateway.config import PolicyConfig, Settings

Request = ChatCompletionRequest | CompletionRequest


class CacheModels:
    """The embedding model and the matcher, loaded on first use (off the event loop, once)."""

    def __init__(self, models_dir: Path, matcher_dir: Path, embedder: Any | None = None,
                 embedding_precision: str | None = None) -> None:
        self.models_dir = models_dir
        self.matcher_dir = matcher_dir
        self.embedding_precision = embedding_precision
        self._loading: asyncio.Task[Matcher] | None = None
        self._loaded = embedder  # the router's, when it has one: one embedding model per process
        self._embedder: asyncio.Task[Any] | None = None

    def _load_embedder(self) -> Any:
        from router.embedding import Embedder

        return Embedder.load(self.models_dir, precision=self.embedding_precision)

    async def embedder(self) -> Any:
        if self._loaded is not None:
            return self._loaded
        if self._embedder is None:
            self._embedder = asyncio.ensure_future(asyncio.to_thread(self._load_embedder))
        return await asyncio.shield(self._embedder)

    async def __call__(self) -> tuple[Any, Matcher]:
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(Matcher.load, self.matcher_dir))
        embedder = await self.embedder()
        return embedder, await asyncio.shield(self._loading)


def cache_models(settings: Settings, embedder: Any | None = None) -> CacheModels:
    """The cache's models; `embedder` is the router's embedding service when it loaded one."""
    matcher_dir = Path(settings.cache.matcher_dir) if settings.cache.matcher_dir else MATCHER_DIR
    return CacheModels(settings.models_cache_dir, matcher_dir, embedder, settings.router.embedder_precision)


def cache_policy(policy: PolicyConfig) -> CachePolicy:
    return CachePolicy(policy.cache, policy.cache_ttl_s, policy.cache_nondeterministic, policy.cache_per_user)


def build_cache(settings: Settings, models: CacheModels, redis_prefix: str = "sluice") -> ResponseCache:
    """Redis when configured (its own connection, with short timeouts: a slow Redis is a down one), else
    this process."""
    cfg = settings.cache
    store: CacheStore
    if settings.redis.url:
        timeout = cfg.redis_timeout_ms / 1000
        redis = Redis.from_url(settings.redis.url, socket_timeout=timeout, socket_connect_timeout=timeout)
        store = RedisCacheStore(redis, redis_prefix)
    else:
        store = MemoryCacheStore(max_entries=cfg.max_entries_in_process)
    return ResponseCache(
        store,
        models,
        max_entries_per_scope=cfg.max_entries_per_scope,
        replica_index_max_entries=cfg.replica_index_max_entries,
        candidates=cfg.candidates,
        retry_after_s=cfg.retry_after_s,
    )


def query_embedding(state: Any, lookup: Lookup) -> np.ndarray | None:
    """Share the embedding: take the router's when it computed one, leave ours for it otherwise."""
    if lookup.vector is not None and getattr(state, "prompt_embedding", None) is None:
        state.prompt_embedding = lookup.vector
    return lookup.vector
