"""Cache fixtures: the real embedding model and the shipped matcher, loaded once; stores on real Redis."""

from __future__ import annotations

import uuid
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
    """New `RedisCacheStore`s on the test's prefix, each with its own connection (as replicas have), keeping
    the vectors for replicas' own indexes (what plain Redis 7 gets)."""
    made: list[RedisCacheStore] = []

    def make() -> RedisCacheStore:
        made.append(RedisCacheStore(Redis.from_url(redis_url), redis_prefix.rstrip(":"), vector_sets=False))
        return made[-1]

    yield make
    for store in made:
        await store.aclose()


@pytest.fixture
async def vector_set_stores(redis8_url: str) -> AsyncIterator[Callable[[], RedisCacheStore]]:
    """The same on a Redis with vector sets, found by the store itself; the test's keys are deleted afterwards."""
    prefix = f"sluice-test:{uuid.uuid4().hex}"
    made: list[RedisCacheStore] = []

    def make() -> RedisCacheStore:
        made.append(RedisCacheStore(Redis.from_url(redis8_url), prefix))
        return made[-1]

    yield make
    cleaner = Redis.from_url(redis8_url)
    keys = [key async for key in cleaner.scan_iter(match=f"{prefix}:*", count=1000)]
    if keys:
        await cleaner.delete(*keys)
    await cleaner.aclose()
    for store in made:
        await store.aclose()


@pytest.fixture(params=["redis", "redis-vector-sets"])
def shared_stores(request: pytest.FixtureRequest) -> Callable[[], RedisCacheStore]:
    """A maker of stores on one Redis, as replicas share it: with replica indexes, or with vector sets."""
    return request.getfixturevalue("redis_stores" if request.param == "redis" else "vector_set_stores")


@pytest.fixture(params=["memory", "redis", "redis-vector-sets"])
def store(request: pytest.FixtureRequest) -> CacheStore:
    if request.param == "memory":
        return MemoryCacheStore()
    if request.param == "redis":
        return request.getfixturevalue("redis_stores")()
    return request.getfixturevalue("vector_set_stores")()


@pytest.fixture
def make_cache(models: Callable) -> Callable[..., ResponseCache]:
    def make(store: CacheStore, **options: object) -> ResponseCache:
        return ResponseCache(store, models, **options)  # type: ignore[arg-type]

    return make
