"""The cache's memory stays bounded however many scopes traffic opens: each conversation, system prompt and end
user is a scope of its own, so a long-running gateway sees scopes without end, most of them written once."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np

from gateway.cache.service import CachePolicy, ResponseCache
from gateway.cache.store import Entry, MemoryCacheStore, ScopeRef
from tests.cache.test_cache import ask, get, put


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def vector(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return v / np.linalg.norm(v)


async def put_entry(store: MemoryCacheStore, scope: str, key: str, ttl_s: float = 60.0, tenant: str = "acme") -> None:
    entry = Entry(b"{}", "chat", f"question {key}", 0.001, 0.0)
    await store.put(ScopeRef(scope, tenant, "search"), key, entry, ttl_s, vector(zlib.crc32(key.encode())), 100)


async def test_expired_entries_go_whichever_scope_they_are_in_and_empty_scopes_are_forgotten():
    clock = Clock()
    store = MemoryCacheStore(clock=clock)
    for i in range(50):  # fifty conversations, each asked once and never again
        await put_entry(store, f"scope-{i}", f"key-{i}")
    assert (len(store), store.scope_count) == (50, 50)
    clock.now += 61
    await put_entry(store, "another", "key-new")  # any put sweeps what expired anywhere
    assert (len(store), store.scope_count) == (1, 1)
    assert await store.get("key-new") is not None


async def test_the_in_process_store_holds_at_most_its_bound_soonest_to_expire_out_first():
    clock = Clock()
    store = MemoryCacheStore(clock=clock, max_entries=3)
    for i in range(5):
        clock.now += 1
        await put_entry(store, f"scope-{i}", f"key-{i}")
    assert len(store) == 3 and store.scope_count == 3
    assert [await store.get(f"key-{i}") is not None for i in range(5)] == [False, False, True, True, True]


async def test_a_purged_scope_is_forgotten_and_its_tenant_with_it():
    store = MemoryCacheStore()
    await put_entry(store, "a", "key-a", tenant="acme")
    await put_entry(store, "b", "key-b", tenant="globex")
    assert await store.purge("acme", None) == 1
    assert store.scope_count == 1 and await store.get("key-a") is None
    assert await store.purge("acme", None) == 0


async def test_a_scope_log_stays_near_its_live_entries():
    store = MemoryCacheStore()
    for i in range(2_000):  # a busy scope bounded at 100 entries: 2,000 adds and 1,900 evictions logged
        await put_entry(store, "busy", f"key-{i}")
    changes = await store.changes("busy", "0")  # a cursor from long ago: the log was trimmed past it
    assert changes.reset and len(changes.events) == 100
    recent = await store.changes("busy", str(store._seq - 1))
    assert not recent.reset and len(recent.events) == 1


async def test_a_scope_stored_again_after_a_purge_does_not_revive_its_old_rows_in_a_replica(make_cache):
    store = MemoryCacheStore()
    writer, reader = make_cache(store), make_cache(store)
    await put(writer, ask("How do I learn Python quickly?"), "Practice daily.")
    assert (await get(reader, ask("What is the fastest way to learn Python?"))).status == "semantic"
    await writer.purge("acme")
    await put(writer, ask("What is the capital of France?"), "Paris.")  # the same scope, born again
    assert (await get(reader, ask("Which city is the capital of France?"))).status == "semantic"
    assert reader.replica_index.entries == 1  # the purged question is not in its index


async def test_replica_indexes_keep_to_their_bound_and_a_dropped_scope_still_hits(make_cache):
    cache: ResponseCache = make_cache(MemoryCacheStore(), replica_index_max_entries=16)  # two scopes' rows
    systems = [f"You answer questions for team {i}." for i in range(5)]
    for system in systems:
        await put(cache, ask("How do I learn Python quickly?", system), "Practice daily.")
    assert cache.replica_index.rows <= 16 and cache.replica_index.scopes <= 2
    hit = await get(cache, ask("What is the fastest way to learn Python?", systems[0]))  # rebuilt from the store
    assert hit.status == "semantic"
    assert cache.replica_index.rows <= 16


async def test_lookups_in_empty_scopes_leave_no_index_behind(make_cache):
    cache = make_cache(MemoryCacheStore())
    for i in range(20):
        assert (await get(cache, ask("How do I learn Python quickly?", f"System prompt {i}."))).status == "miss"
    assert cache.replica_index.scopes == 0


async def test_an_index_of_entries_that_all_expired_is_dropped(make_cache):
    cache = make_cache(MemoryCacheStore())
    brief = CachePolicy(mode="semantic", ttl_s=0.05)
    await put(cache, ask("How do I learn Python quickly?"), "Practice daily.", brief)
    await asyncio.sleep(0.1)
    await put(cache, ask("What is the capital of France?"), "Paris.", brief, feature="other")  # sweeps the first
    assert (await get(cache, ask("What is the fastest way to learn Python?"), brief)).status == "miss"
    assert cache.replica_index.scopes == 0  # its scope is gone from the store: the index emptied and was dropped


async def test_a_tenants_list_of_scopes_in_redis_drops_the_scopes_whose_entries_all_expired(redis_stores):
    store = redis_stores()
    entry = Entry(b"{}", "chat", "question", 0.001, 0.0)
    for i in range(3):
        await store.put(ScopeRef(f"{i:032x}", "acme", "search"), f"short-{i}", entry, 0.05, vector(i), 100)
    await asyncio.sleep(0.1)
    await store.put(ScopeRef("f" * 32, "acme", "search"), "long", entry, 60.0, vector(9), 100)
    assert await store.redis.zrange(store._tenant_scopes("acme"), 0, -1) == [f"{'f' * 32}:search".encode()]


async def test_a_purge_also_finds_scopes_listed_the_way_earlier_versions_listed_them(redis_stores, make_cache):
    cache = make_cache(redis_stores())
    lookup = await put(cache, ask("How do I learn Python quickly?"), "Practice daily.")
    store = cache.backend
    registry = store._tenant_scopes("acme")
    await store.redis.delete(registry)  # as written before the tenant's scopes were a sorted set
    await store.redis.hset(f"{store.prefix}:t:acme", lookup.key.scope, "search")
    assert await cache.purge("acme") == 1
    assert (await get(cache, ask("How do I learn Python quickly?"))).status == "miss"
    assert await store.redis.exists(f"{store.prefix}:t:acme") == 0


async def test_a_replica_drops_its_index_of_a_scope_that_expired_in_redis(redis_stores, make_cache):
    writer, reader = make_cache(redis_stores()), make_cache(redis_stores())
    brief = CachePolicy(mode="semantic", ttl_s=0.1)
    await put(writer, ask("How do I learn Python quickly?"), "Practice daily.", brief)
    assert (await get(reader, ask("What is the fastest way to learn Python?"), brief)).status == "semantic"
    assert reader.replica_index.entries == 1
    await asyncio.sleep(0.2)  # the entry, the scope's vectors and its log expire in Redis; no put since
    assert (await get(reader, ask("What is the fastest way to learn Python?"), brief)).status == "miss"
    assert reader.replica_index.scopes == 0
