"""Cache fixtures: the real embedding model and the shipped matcher, loaded once; stores on real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from gateway.cache.service import ResponseCache
from gateway.cache.store import CacheStore, MemoryCacheStore, RedisCacheStore
from gateway.cache.verifier import MATCHER_DIR, Matcher
from router.embedding import Embedder
from tests.gateway.conftest import records, tiers  # noqa: F401 - the gateway fixtures, shared


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder.load()


# The cache's mechanics tests (scopes, TTL, replicas...) need paraphrases that hit: they run the shipped
# model at this lower threshold. The shipped operating point is tested on held-out data (test_matcher.py).
MECHANICS_THRESHOLD = 0.5


@pytest.fixture(scope="session")
def matcher() -> Matcher:
    if not (MATCHER_DIR / "model.onnx").exists():
        pytest.skip(f"no matcher artifact at {MATCHER_DIR}: build it with `make cache-matcher`")
    return Matcher.load()


@pytest.fixture(scope="session")
def mechanics_matcher() -> Matcher:
    if not (MATCHER_DIR / "model.onnx").exists():
        pytest.skip(f"no matcher artifact at {MATCHER_DIR}: build it with `make cache-matcher`")
    return Matcher.load(threshold=MECHANICS_THRESHOLD)


@pytest.fixture
def models(embedder: Embedder, mechanics_matcher: Matcher) -> Callable:
    async def load() -> tuple[Embedder, Matcher]:
        return embedder, mechanics_matcher

    return load


@pytest.fixture
async def redis_stores(redis_url: str, redis_prefix: str) -> AsyncIterator[Callable[[], RedisCacheStore]]:
    """New `RedisCacheStore`s on the test's prefix, each with its own connection (as replicas have)."""
    made: list[RedisCacheStore] = []

    def make() -> RedisCacheStore:
        made.append(RedisCacheStore(Redis.from_url(redis_url), redis_prefix.rstrip(":")))
        return made[-1]

    yield make
    for store in made:
        await store.aclose()


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> CacheStore:
    if request.param == "memory":
        return MemoryCacheStore()
    return request.getfixturevalue("redis_stores")()


@pytest.fixture
def make_cache(models: Callable) -> Callable[..., ResponseCache]:
    def make(store: CacheStore, **options: object) -> ResponseCache:
        return ResponseCache(store, models, **options)  # type: ignore[arg-type]

    return make
