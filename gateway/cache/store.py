"""Where cached answers live: Redis (the source of truth shared by every replica) or this process.

Per entry: the answer under `e:<key>` with the feature's TTL. Per scope: a sorted set of its keys by
expiry (expired ones are dropped and the oldest evicted past `max_entries` on every put) and the
semantic tier's vectors, kept one of two ways:

- plain Redis 7: a hash of the vectors and a change log (a Redis stream: add / del / purge) from which
  each replica keeps its in-memory `VectorIndex` current. A replica reads the log since its cursor
  before searching; one that fell behind the log's trimmed start reloads the vectors from the hash;
- Redis 8 (detected: the server knows the vector-set commands): a vector set, searched in Redis with `VSIM`
  (`RedisCacheStore.nearest`); replicas then keep no index.

Either way a candidate is read from the store before it is served, so TTLs, evictions and purges hold
in every replica at once. Per tenant, for purging: a sorted set of its scopes (`scope:feature`) by the time
the last of their entries expires, so scopes whose entries all expired drop out of it on the next put.

`MemoryCacheStore` has the same semantics without Redis (`make run`, one replica).
"""

from __future__ import annotations

import bisect
import heapq
import struct
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import numpy as np

# A vector record: expiry (unix seconds), float count, the floats, then the question's UTF-8 text.
RECORD = struct.Struct("<dI")


class CacheUnavailable(Exception):
    """The store cannot be reached: the cache is bypassed for this request."""


class Entry(msgspec.Struct, array_like=True):
    body: bytes  # the answer as JSON (a chat.completion or text_completion object)
    endpoint: str
    query: str  # the text it answered, what the matcher compares a new query with
    cost_usd: float  # what generating it cost: what a hit saves
    created: float


_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(Entry)


@dataclass(frozen=True, slots=True)
class ScopeRef:
    id: str
    tenant: str
    feature: str


@dataclass(frozen=True, slots=True)
class IndexEvent:
    op: str  # add | del | purge
    key: str = ""
    vector: np.ndarray | None = None
    expires_at: float = 0.0
    text: str = ""  # the cached question: what the matcher reads beside the new one


@dataclass(slots=True)
class IndexChanges:
    events: list[IndexEvent]
    cursor: str
    reset: bool  # drop the replica's index first: `events` is a full snapshot


def pack_vector(vector: np.ndarray, expires_at: float, text: str) -> bytes:
    floats = np.asarray(vector, dtype=np.float32)
    return RECORD.pack(expires_at, len(floats)) + floats.tobytes() + text.encode()


def unpack_vector(key: str, packed: bytes) -> IndexEvent:
    expires_at, n = RECORD.unpack_from(packed)
    vector = np.frombuffer(packed, dtype=np.float32, count=n, offset=RECORD.size)
    return IndexEvent("add", key, vector, expires_at, packed[RECORD.size + 4 * n :].decode())


@dataclass(frozen=True, slots=True)
class Candidate:
    """A cached question near a new one, for the matcher: its key, the cosine of the two embeddings, its text,
    and its entry when the search read it (None: read it before serving)."""

    key: str
    cosine: float
    text: str
    entry: Entry | None = None


class CacheStore(Protocol):
    async def get(self, key: str) -> Entry | None: ...

    async def nearest(self, scope: str, vector: np.ndarray, k: int, floor: float) -> list[Candidate] | None:
        """Up to k live entries of the scope with cosine ≥ floor, best first; None when the store does not
        search vectors (each replica searches its own index, kept current by `changes`)."""
        ...

    async def put(
        self, scope: ScopeRef, key: str, entry: Entry, ttl_s: float, vector: np.ndarray | None, max_entries: int
    ) -> None: ...

    async def changes(self, scope: str, cursor: str | None) -> IndexChanges: ...

    async def purge(self, tenant: str, feature: str | None) -> int: ...

    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------------

# KEYS: entry, expiry zset, vector hash, change log, tenant's scopes, vector set. ARGV[11] = '1': the vector
# goes to the vector set (ARGV[5] its float32 bytes), else to the hash and the log (ARGV[5] a packed record).
# Vector sets store int8 vectors (Q8, Redis's default) and build with EF 100: 0.9 ms an insert at 20k entries
# against 2.2 ms for float32 at EF 200, the nearest one still found (BENCHMARKS.md). Redis runs scripts one at a
# time, so an insert's cost bounds a server's cache writes.
_PUT = """
local ttl, now, vset = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[11] == '1'
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
local function drop(k)
  redis.call('ZREM', KEYS[2], k)
  if vset then
    redis.call('VREM', KEYS[6], k)
  elseif redis.call('HDEL', KEYS[3], k) == 1 then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[8], '*', 'op', 'del', 'k', k)
  end
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do drop(k) end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
if ARGV[5] ~= '' then
  if vset then
    redis.call('VADD', KEYS[6], 'FP32', ARGV[5], ARGV[4], 'Q8', 'EF', 100)
  else
    redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[8], '*', 'op', 'add', 'k', ARGV[4], 'v', ARGV[5])
  end
end
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[6])
if over > 0 then
  for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do
    redis.call('DEL', ARGV[7] .. k)
    drop(k)
  end
end
-- The scope's structures, and the tenant's list of scopes, live as long as their longest-lived entry: a shorter
-- TTL never shortens them; a scope leaves the list once its last entry has expired.
redis.call('ZADD', KEYS[5], 'GT', now + ttl, ARGV[9] .. ':' .. ARGV[10])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
for _, i in ipairs({2, 3, 4, 5, 6}) do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return over
"""

# KEYS: expiry zset, vector hash, change log, vector set.
_PURGE = """
local keys = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, k in ipairs(keys) do redis.call('DEL', ARGV[1] .. k) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'op', 'purge')
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return #keys
"""


class RedisCacheStore:
    """Plain Redis 7 commands and Lua; on Redis 8 also its vector sets (`vector_sets=None`: use them when the
    server has them)."""

    def __init__(self, redis: object, prefix: str = "sluice", log_length: int = 20_000,
                 vector_sets: bool | None = None) -> None:
        from redis.asyncio import Redis

        assert isinstance(redis, Redis)
        self.redis = redis
        self.prefix = f"{prefix}:cache"
        self.log_length = log_length  # past this the log is trimmed; a replica further behind reloads
        self.vector_sets = vector_sets
        self._put = redis.register_script(_PUT)
        self._purge = redis.register_script(_PURGE)

    async def uses_vector_sets(self) -> bool:
        """Whether the scopes' vectors live in Redis vector sets: asked of the server once (before Redis 8 it
        does not know `VCARD`). Every replica asks the same server, so all of them agree."""
        if self.vector_sets is None:
            from redis.exceptions import ResponseError

            try:
                await self.redis.execute_command("VCARD", f"{self.prefix}:probe")
                self.vector_sets = True
            except ResponseError:
                self.vector_sets = False  # unknown command
            except Exception as exc:
                raise CacheUnavailable(str(exc)) from exc
        return self.vector_sets

    def _entry(self, key: str) -> str:
        return f"{self.prefix}:e:{key}"

    def _scope(self, scope: str, part: str) -> str:
        return f"{self.prefix}:s:{scope}:{part}"

    def _tenant_scopes(self, tenant: str) -> str:
        return f"{self.prefix}:tz:{tenant}"

    async def get(self, key: str) -> Entry | None:
        try:
            raw = await self.redis.get(self._entry(key))
        except Exception as exc:
            raise CacheUnavailable(str(exc)) from exc
        return None if raw is None else _entry_decoder.decode(raw)

    async def nearest(self, scope: str, vector: np.ndarray, k: int, floor: float) -> list[Candidate] | None:
        if not await self.uses_vector_sets():
            return None
        blob = np.asarray(vector, dtype=np.float32).tobytes()
        try:
            # Twice k: vectors of entries that expired since the scope's last put are still in the set.
            found = await self.redis.execute_command(
                "VSIM", self._scope(scope, "vs"), "FP32", blob, "WITHSCORES", "COUNT", 2 * k
            )
            pairs = [(m.decode(), 2.0 * float(s) - 1.0) for m, s in _pairs(found)]  # VSIM's score is (1 + cos) / 2
            pairs = [(key, cosine) for key, cosine in pairs if cosine >= floor]
            raw = await self.redis.mget([self._entry(key) for key, _ in pairs]) if pairs else []
        except Exception as exc:
            raise CacheUnavailable(str(exc)) from exc
        # An entry gone (expired, evicted) leaves its vector until the scope's next put drops it: skip it.
        entries = [(key, cosine, _entry_decoder.decode(body)) for (key, cosine), body in zip(pairs, raw, strict=True)
                   if body is not None]
        return [Candidate(key, cosine, entry.query, entry) for key, cosine, entry in entries[:k]]

    async def put(
        self, scope: ScopeRef, key: str, entry: Entry, ttl_s: float, vector: np.ndarray | None, max_entries: int
    ) -> None:
        now = time.time()
        ttl_ms = max(1, int(ttl_s * 1000))
        vector_set = await self.uses_vector_sets()
        if vector is None:
            packed = b""
        elif vector_set:
            packed = np.asarray(vector, dtype=np.float32).tobytes()
        else:
            packed = pack_vector(vector, now + ttl_s, entry.query)
        keys = [
            self._entry(key),
            *(self._scope(scope.id, p) for p in ("z", "v", "log")),
            self._tenant_scopes(scope.tenant),
            self._scope(scope.id, "vs"),
        ]
        args = [
            _entry_encoder.encode(entry),
            ttl_ms,
            int(now * 1000),
            key,
            packed,
            max_entries,
            f"{self.prefix}:e:",
            self.log_length,
            scope.id,
            scope.feature,
            "1" if vector_set else "0",
        ]
        try:
            await self._put(keys=keys, args=args)
        except Exception as exc:
            raise CacheUnavailable(str(exc)) from exc

    async def changes(self, scope: str, cursor: str | None) -> IndexChanges:
        log, vectors = self._scope(scope, "log"), self._scope(scope, "v")
        try:
            if cursor is not None:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xrange(log, min=f"({cursor}", count=self.log_length)
                    pipe.xrange(log, count=1)
                    tail, first = await pipe.execute()
                if not first:  # no log: the scope expired (or was never written), and its vectors with it
                    return IndexChanges([], "0-0", reset=True)
                if _stream_id(first[0][0]) <= _stream_id(cursor):
                    events = [_event(fields) for _, fields in tail]
                    return IndexChanges(events, tail[-1][0].decode() if tail else cursor, reset=False)
            async with self.redis.pipeline(transaction=True) as pipe:  # one consistent snapshot
                pipe.xrevrange(log, count=1)
                pipe.hgetall(vectors)
                last, snapshot = await pipe.execute()
        except Exception as exc:
            raise CacheUnavailable(str(exc)) from exc
        events = [unpack_vector(k.decode(), v) for k, v in snapshot.items()]
        return IndexChanges(events, last[0][0].decode() if last else "0-0", reset=True)

    async def purge(self, tenant: str, feature: str | None) -> int:
        registry = self._tenant_scopes(tenant)
        legacy = f"{self.prefix}:t:{tenant}"  # the hash scope → feature that earlier versions kept
        try:
            members = [m.decode() for m in await self.redis.zrange(registry, 0, -1)]
            scopes = dict(m.split(":", 1) for m in members)  # a scope id is hex: the first ':' ends it
            scopes |= {s.decode(): f.decode() for s, f in (await self.redis.hgetall(legacy)).items()}
            purged = 0
            for scope, owner in scopes.items():
                if feature is None or owner == feature:
                    keys = [self._scope(scope, p) for p in ("z", "v", "log", "vs")]
                    purged += int(await self._purge(keys=keys, args=[f"{self.prefix}:e:", self.log_length, 86_400_000]))
                    await self.redis.zrem(registry, f"{scope}:{owner}")
                    await self.redis.hdel(legacy, scope)
            return purged
        except Exception as exc:
            raise CacheUnavailable(str(exc)) from exc

    async def aclose(self) -> None:
        await self.redis.aclose()


def _pairs(reply: object) -> list[tuple[bytes, bytes]]:
    """VSIM ... WITHSCORES: a flat [member, score, ...] list (RESP2) or a member → score map (RESP3)."""
    if isinstance(reply, dict):
        return list(reply.items())
    items = list(reply or [])  # type: ignore[call-overload]
    return list(zip(items[0::2], items[1::2], strict=True))


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _event(fields: dict[bytes, bytes]) -> IndexEvent:
    op = fields[b"op"].decode()
    if op == "add":
        return unpack_vector(fields[b"k"].decode(), fields[b"v"])
    return IndexEvent(op, fields.get(b"k", b"").decode())


# ---------------------------------------------------------------------------------------------
# In process
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Scope:
    tenant: str
    expiry: dict[str, float] = field(default_factory=dict)
    vectors: dict[str, bytes] = field(default_factory=dict)
    log: list[tuple[int, IndexEvent]] = field(default_factory=list)
    trimmed_to: int = 0  # a cursor before it reloads the scope: the log's trimmed start, or the scope's birth
    by_expiry: list[tuple[float, str]] = field(default_factory=list)  # a heap; items whose key moved are stale


class MemoryCacheStore:
    """The same store in this process, for a gateway without Redis.

    Memory stays bounded however many scopes traffic opens (every conversation and end user is one): expired
    entries are dropped on any put, whichever scope they are in, a scope with no entries left is forgotten
    (with its change log: a replica index of it then resets to empty), at most `max_entries` entries are held
    in all (soonest to expire out first), and a scope's log is kept near its live entries."""

    def __init__(self, log_length: int = 20_000, clock: object = time.time, max_entries: int = 100_000) -> None:
        self.log_length = log_length
        self.clock = clock
        self.max_entries = max_entries
        self._entries: dict[str, tuple[Entry, float]] = {}
        self._scopes: dict[str, _Scope] = {}
        self._tenants: dict[str, dict[str, str]] = {}
        self._by_expiry: list[tuple[float, str, str]] = []  # (expires, scope, key) over all scopes; stale items skipped
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included."""
        return len(self._entries)

    @property
    def scope_count(self) -> int:
        return len(self._scopes)

    async def nearest(self, scope: str, vector: np.ndarray, k: int, floor: float) -> list[Candidate] | None:
        return None  # the replica's own index searches (one replica: the log never falls behind)

    async def get(self, key: str) -> Entry | None:
        item = self._entries.get(key)
        if item is None or item[1] <= self.clock():  # type: ignore[operator]
            self._entries.pop(key, None)
            return None
        return item[0]

    def _log(self, scope: _Scope, event: IndexEvent) -> None:
        self._seq += 1
        scope.log.append((self._seq, event))
        # A replica reads the log since its cursor; one behind the trimmed start reloads the scope's vectors. Past
        # twice the live entries the log is mostly history (an add event holds its vector): trim it to half that.
        limit = min(self.log_length, 2 * len(scope.vectors) + 64)
        if len(scope.log) > limit:
            cut = len(scope.log) - limit // 2
            scope.trimmed_to = scope.log[cut - 1][0]
            del scope.log[:cut]

    def _drop(self, scope: _Scope, key: str) -> None:
        scope.expiry.pop(key, None)
        self._entries.pop(key, None)
        if scope.vectors.pop(key, None) is not None:
            self._log(scope, IndexEvent("del", key))

    async def put(
        self, scope: ScopeRef, key: str, entry: Entry, ttl_s: float, vector: np.ndarray | None, max_entries: int
    ) -> None:
        now: float = self.clock()  # type: ignore[operator]
        s = self._scopes.get(scope.id)
        if s is None:
            # Cursors from before this scope existed (or from its purged past) predate `trimmed_to`: a replica
            # holding one reloads the scope instead of keeping rows of its earlier life.
            s = self._scopes[scope.id] = _Scope(scope.tenant, trimmed_to=self._seq + 1)
            self._tenants.setdefault(scope.tenant, {})[scope.id] = scope.feature
        expires = now + ttl_s
        self._entries[key] = (entry, expires)
        s.expiry[key] = expires
        heapq.heappush(s.by_expiry, (expires, key))
        heapq.heappush(self._by_expiry, (expires, scope.id, key))
        if vector is not None:
            s.vectors[key] = pack_vector(vector, expires, entry.query)
            self._log(s, unpack_vector(key, s.vectors[key]))
        # Soonest expiry first: the expired, then the oldest while the scope is over its bound.
        while s.by_expiry and (s.by_expiry[0][0] <= now or len(s.expiry) > max_entries):
            expires, k = heapq.heappop(s.by_expiry)
            if s.expiry.get(k) == expires:
                self._drop(s, k)
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Drop what expired in any scope, then the soonest to expire while more than `max_entries` are held."""
        while self._by_expiry and (self._by_expiry[0][0] <= now or len(self._entries) > self.max_entries):
            expires, scope_id, key = heapq.heappop(self._by_expiry)
            s = self._scopes.get(scope_id)
            if s is None:
                continue  # purged
            if s.expiry.get(key) == expires:  # else stale: stored again since, or already dropped
                self._drop(s, key)
            if not s.expiry:
                self._forget(scope_id)

    def _forget(self, scope_id: str) -> None:
        s = self._scopes.pop(scope_id)
        owners = self._tenants.get(s.tenant, {})
        owners.pop(scope_id, None)
        if not owners:
            self._tenants.pop(s.tenant, None)

    async def changes(self, scope: str, cursor: str | None) -> IndexChanges:
        s = self._scopes.get(scope)
        if s is None:
            return IndexChanges([], str(self._seq), reset=cursor is not None)
        since = int(cursor) if cursor is not None else None
        if since is not None and since >= s.trimmed_to:
            # The log is in sequence order: find the cursor, never scan the whole log on every lookup.
            start = bisect.bisect_right(s.log, since, key=lambda item: item[0])
            events = [event for _, event in s.log[start:]]
            return IndexChanges(events, str(s.log[-1][0]) if s.log else cursor, reset=False)  # type: ignore[arg-type]
        events = [unpack_vector(k, v) for k, v in s.vectors.items()]
        return IndexChanges(events, str(s.log[-1][0]) if s.log else "0", reset=True)

    async def purge(self, tenant: str, feature: str | None) -> int:
        purged = 0
        for scope_id, owner in list(self._tenants.get(tenant, {}).items()):
            if feature is None or owner == feature:
                for k in self._scopes[scope_id].expiry:
                    purged += self._entries.pop(k, None) is not None
                self._forget(scope_id)  # a replica index of it resets to empty on its next sync
        return purged

    async def aclose(self) -> None:
        return None
