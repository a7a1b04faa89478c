"""The response cache as the request path sees it: `begin` (look up, or lead the miss), `store`, `release`.

Exact tier: the entry whose key is the hash of scope + query. Semantic tier: the scope's nearest
cached questions by embedding (cosine ≥ the matcher's floor; searched in Redis 8's vector sets, else in
this replica's index), read together with the new question by the matcher; the best one at or above the
matcher's threshold is read from the store and served. A question too long for the matcher to read whole
beside a candidate is served by the exact tier only: a verdict on a cut text would miss a difference after the cut.
Identical misses in this replica wait for the first one (single flight) and are then served from the
cache. When the store fails the cache is bypassed for `retry_after_s` and requests are served as if
it were off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.cache.index import VectorIndex
from gateway.cache.keys import CacheKey, cache_control, cache_key, end_user, is_deterministic
from gateway.cache.store import CacheStore, CacheUnavailable, Candidate, Entry, IndexChanges, ScopeRef
from gateway.cache.verifier import Matcher

log = logging.getLogger("sluice.cache")

Status = Literal["off", "bypass", "miss", "exact", "semantic"]


class Embeds:
    """What the semantic tier needs of the embedding service (router.embedding.Embedder)."""

    version: str
    dim: int

    async def embed_async(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class CachePolicy:
    mode: Literal["off", "exact", "semantic"]
    ttl_s: float
    nondeterministic: bool = False  # the feature opted in to reusing answers sampled at temperature > 0
    per_user: bool = True  # each end user (`user`, else `safety_identifier`) has a scope of their own


@dataclass(frozen=True, slots=True)
class Hit:
    entry: Entry
    status: Literal["exact", "semantic"]
    similarity: float  # cosine of the two questions (1.0 for an exact hit)
    score: float | None = None  # the matcher's, for a semantic hit


@dataclass(slots=True)
class Lookup:
    status: Status
    key: CacheKey | None = None
    scope: ScopeRef | None = None
    policy: CachePolicy | None = None
    write: bool = False
    vector: np.ndarray | None = None
    hit: Hit | None = None
    leader: bool = False


@dataclass(frozen=True, slots=True)
class IndexFootprint:
    scopes: int
    entries: int  # live rows
    rows: int  # rows allocated: what `replica_index_max_entries` bounds


@dataclass(slots=True)
class _Replica:
    index: VectorIndex
    cursor: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ResponseCache:
    def __init__(
        self,
        store: CacheStore,
        models: Callable[[], Awaitable[tuple[Embeds, Matcher]]],
        *,
        max_entries_per_scope: int = 10_000,
        replica_index_max_entries: int = 200_000,
        candidates: int = 2,
        retry_after_s: float = 1.0,
        flight_wait_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = store
        self._load_models = models
        self.max_entries_per_scope = max_entries_per_scope
        self.replica_index_max_entries = replica_index_max_entries
        self.candidates = candidates
        self.retry_after_s = retry_after_s
        self.flight_wait_s = flight_wait_s
        self.clock = clock
        # This replica's indexes of the scopes it searched, least recently searched first: bounded by the rows they
        # hold (`replica_index_max_entries`), since traffic opens scopes without end (each conversation, each user).
        self._replicas: OrderedDict[str, _Replica] = OrderedDict()
        self._replica_rows = 0
        self._flights: dict[str, asyncio.Future[None]] = {}
        self._down_until = 0.0

    # -- the request path -----------------------------------------------------------------------

    async def begin(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        policy: CachePolicy,
        *,
        tenant: str,
        feature: str,
        endpoint: str,
        tier: str,
        control: str | None = None,
        embedding: np.ndarray | None = None,
    ) -> Lookup:
        """Look the request up. A miss that may be stored comes back with `leader` set: the caller must
        end it with `store` or `release`."""
        read, write = cache_control(control)
        if policy.mode == "off" or not (read or write) or not is_deterministic(request, policy.nondeterministic):
            return Lookup("off")
        if self.clock() < self._down_until:
            return Lookup("bypass")
        versions, matcher = "exact", None
        if policy.mode == "semantic":
            embedder, matcher = await self._load_models()
            versions = f"{embedder.version}+{matcher.version}"
        key = cache_key(request, tenant=tenant, feature=feature, endpoint=endpoint, tier=tier, versions=versions,
                        end_user=end_user(request) if policy.per_user else None)
        if key is None:
            return Lookup("off")
        if matcher is not None and key.semantic and not matcher.reads_whole(key.query):
            key = replace(key, semantic=False)  # the matcher could judge only a cut text: exact tier only
        lookup = Lookup("miss", key, ScopeRef(key.scope, tenant, feature), policy, write, embedding)
        try:
            if read and await self._find(lookup):
                return lookup
            if await self._follow(key.exact) and read and await self._find(lookup, exact_only=True):
                return lookup
        except CacheUnavailable as exc:
            return self._bypass(exc)
        if write:
            self._flights[key.exact] = asyncio.get_running_loop().create_future()
            lookup.leader = True
        return lookup

    async def store(self, lookup: Lookup, body: bytes, cost_usd: float) -> None:
        """Keep the answer of a led miss, then let its followers in."""
        try:
            if lookup.write and lookup.key is not None and lookup.scope is not None and lookup.policy is not None:
                entry = Entry(body, lookup.scope.feature, lookup.key.query, cost_usd, self.clock())
                vector = await self._vector_to_keep(lookup)
                await self.backend.put(
                    lookup.scope, lookup.key.exact, entry, lookup.policy.ttl_s, vector, self.max_entries_per_scope
                )
        except CacheUnavailable as exc:
            self._bypass(exc)
        finally:
            self.release(lookup)

    def release(self, lookup: Lookup) -> None:
        """End a led miss without storing (the answer failed or is not cacheable)."""
        if lookup.leader and lookup.key is not None:
            lookup.leader = False
            flight = self._flights.pop(lookup.key.exact, None)
            if flight is not None and not flight.done():
                flight.set_result(None)

    async def purge(self, tenant: str, feature: str | None = None) -> int:
        """Delete every entry of a tenant (or of one of its features), in every replica."""
        return await self.backend.purge(tenant, feature)

    # -- internals ------------------------------------------------------------------------------

    async def _vector_to_keep(self, lookup: Lookup) -> np.ndarray | None:
        """The question's embedding for the semantic tier (computed now when the lookup was skipped by
        `Cache-Control: no-cache` and no router embedded the request); None for an exact-only entry."""
        assert lookup.policy is not None and lookup.key is not None
        if lookup.policy.mode != "semantic" or not lookup.key.semantic:
            return None
        return await self._query_vector(lookup)

    async def _query_vector(self, lookup: Lookup) -> np.ndarray:
        """The question's embedding: the router's when it computed one, else computed once here."""
        assert lookup.key is not None
        if lookup.vector is None:
            embedder, _ = await self._load_models()
            lookup.vector = (await embedder.embed_async([lookup.key.query]))[0]
        return lookup.vector

    async def _follow(self, exact: str) -> bool:
        """Wait for the same miss led elsewhere in this replica; True if there was one."""
        flight = self._flights.get(exact)
        if flight is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(flight), self.flight_wait_s)
        except TimeoutError:
            return False
        return True

    async def _find(self, lookup: Lookup, exact_only: bool = False) -> bool:
        assert lookup.key is not None and lookup.policy is not None
        entry = await self.backend.get(lookup.key.exact)
        if entry is not None:
            lookup.status, lookup.hit = "exact", Hit(entry, "exact", 1.0)
            return True
        if exact_only or lookup.policy.mode != "semantic" or not lookup.key.semantic:
            return False
        embedder, matcher = await self._load_models()
        vector = await self._query_vector(lookup)
        found = await self._nearest(lookup.key.scope, vector, embedder.dim, matcher.floor)
        if not found:
            return False
        probabilities = await matcher.score_async([lookup.key.query] * len(found), [c.text for c in found])
        scores = matcher.rule_score(probabilities, np.array([c.cosine for c in found]))
        for i in np.argsort(-scores):
            if scores[i] < matcher.threshold:
                break
            key, cosine = found[i].key, found[i].cosine
            entry = found[i].entry or await self.backend.get(key)  # read now: TTL, eviction, purge hold everywhere
            if entry is None:
                self._forget(lookup.key.scope, key)
                continue
            if key == lookup.key.exact:  # stored by another request since the exact read: the same question
                lookup.status, lookup.hit = "exact", Hit(entry, "exact", 1.0)
            else:
                lookup.status, lookup.hit = "semantic", Hit(entry, "semantic", cosine, float(scores[i]))
            return True
        return False

    async def _nearest(self, scope: str, vector: np.ndarray, dim: int, floor: float) -> list[Candidate]:
        """The scope's nearest cached questions: searched by the store (Redis vector sets), else by this
        replica's index after it caught up with the store's change log."""
        searched = await self.backend.nearest(scope, vector, self.candidates, floor)
        if searched is not None:
            return searched
        replica = await self._sync(scope, dim)
        found = replica.index.search(vector, self.candidates, floor, self.clock())
        return [Candidate(key, cosine, replica.index.texts[key]) for key, cosine in found]

    def _forget(self, scope: str, key: str) -> None:
        replica = self._replicas.get(scope)
        if replica is not None:
            replica.index.remove(key)

    async def _sync(self, scope: str, dim: int) -> _Replica:
        replica = self._replicas.get(scope)
        if replica is None:
            replica = self._replicas[scope] = _Replica(VectorIndex(dim))
        self._replicas.move_to_end(scope)
        async with replica.lock:
            held = replica.index.rows_held
            changes = await self.backend.changes(scope, replica.cursor)
            _apply(replica, changes)
            if self._replicas.get(scope) is replica:  # else dropped meanwhile, its rows no longer counted
                self._replica_rows += replica.index.rows_held - held
                if not len(replica.index):  # an empty scope costs nothing to find empty again
                    self._drop_replica(scope)
        while self._replica_rows > self.replica_index_max_entries and len(self._replicas) > 1:
            self._drop_replica(next(iter(self._replicas)))  # the least recently searched; rebuilt when searched again
        return replica

    def _drop_replica(self, scope: str) -> None:
        self._replica_rows -= self._replicas.pop(scope).index.rows_held

    @property
    def replica_index(self) -> IndexFootprint:
        """What this replica's indexes hold now."""
        entries = sum(len(replica.index) for replica in self._replicas.values())
        return IndexFootprint(len(self._replicas), entries, self._replica_rows)

    def _bypass(self, exc: Exception) -> Lookup:
        if self.clock() >= self._down_until:
            log.warning("response cache unavailable, bypassed for %.1fs: %s", self.retry_after_s, exc)
        self._down_until = self.clock() + self.retry_after_s
        return Lookup("bypass")

    async def aclose(self) -> None:
        await self.backend.aclose()


def _apply(replica: _Replica, changes: IndexChanges) -> None:
    if changes.reset:
        replica.index.clear()
    for event in changes.events:
        if event.op == "add" and event.vector is not None:
            replica.index.add(event.key, event.vector, event.expires_at, event.text)
        elif event.op == "del":
            replica.index.remove(event.key)
        elif event.op == "purge":
            replica.index.clear()
    replica.cursor = changes.cursor
