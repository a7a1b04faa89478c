"""Virtual API keys: `sk-sluice-<random>` secrets bound to a tenant, a feature and policy overrides.

Only the SHA-256 of a secret is stored. `create_key`, `list_keys` and `revoke_key` are what the
admin API and the `sluice keys` CLI call. The request path authenticates through `KeyCache`, which
remembers each lookup (found or not) for `ttl_s` seconds, so the database is read at most once
per secret per TTL. An expired entry is still answered while one background read refreshes it,
so no request waits on the database for a secret it has seen: a revocation made elsewhere takes
effect within `DEFAULT_KEY_CACHE_TTL_S` seconds plus one database read (at once on the replica
that revoked it).

Unauthenticated traffic stays cheap: a secret not of the shape `new_secret` makes is refused without
a read, and a well-formed one is looked up only when its display prefix belongs to an active key.
The set of active prefixes is read at most once per `PREFIX_REFRESH_S` however many unknown secrets
arrive (a flood of random keys costs a handful of reads a second, not one each); a key created a
moment ago waits at most that long for the next read, and is never refused for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.config import PolicyConfig, Settings
from gateway.db.schema import api_keys

logger = logging.getLogger(__name__)

SECRET_PREFIX = "sk-sluice-"
DISPLAY_PREFIX_LEN = 14  # "sk-sluice-" plus four random characters: enough to recognise a key
DEFAULT_KEY_CACHE_TTL_S = 2.0
_MAX_CACHED_SECRETS = 100_000
PREFIX_REFRESH_S = 0.25
_SECRET_SHAPE = re.compile(re.escape(SECRET_PREFIX) + r"[A-Za-z0-9_-]{43}")  # token_urlsafe(32)


class KeyStoreUnavailable(Exception):
    """The key store (the database) cannot be read, and this secret is not cached."""


class InvalidPolicy(ValueError):
    """Policy overrides name an unknown field or hold a wrong type."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    prefix: str
    tenant: str
    feature: str
    name: str
    policy: dict[str, Any]  # overrides of the feature's policy
    created_at: datetime
    revoked_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    key: ApiKey
    secret: str  # shown once; only its hash is stored


def _check_text(value: str, name: str, max_len: int) -> str:
    """Names go into indexed columns and listings: non-empty, bounded, no control characters."""
    if not value or len(value) > max_len or not value.isprintable():
        raise ValueError(f"{name} must be 1 to {max_len} printable characters")
    return value


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def validate_policy_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides, checked field by field against `PolicyConfig`; raises `InvalidPolicy`."""
    try:
        merged = msgspec.convert({**msgspec.to_builtins(PolicyConfig()), **overrides}, PolicyConfig)
    except msgspec.ValidationError as exc:
        raise InvalidPolicy(f"policy: {exc}") from exc
    return {name: msgspec.to_builtins(getattr(merged, name)) for name in overrides}


def effective_policy(settings: Settings, feature: str, overrides: Mapping[str, Any]) -> PolicyConfig:
    """The feature's policy from config with the key's stored overrides on top."""
    base = settings.policy_for(feature)
    if not overrides:
        return base
    return msgspec.convert({**msgspec.to_builtins(base), **overrides}, PolicyConfig)


def anonymous_policy(settings: Settings) -> PolicyConfig:
    """The anonymous feature's policy, with the server's anonymous limits wherever it sets none:
    an open gateway is never an unlimited one by default."""
    server = settings.server
    policy = settings.policy_for(server.anonymous_feature)
    defaults = {"rpm": server.anonymous_rpm, "tpm": server.anonymous_tpm}
    defaults["spend_per_day_usd"] = server.anonymous_spend_per_day_usd  # type: ignore[assignment]
    missing = {name: value or None for name, value in defaults.items() if getattr(policy, name) is None}
    return msgspec.structs.replace(policy, **missing) if missing else policy


def _row_to_key(row: sa.Row[Any]) -> ApiKey:
    return ApiKey(
        id=row.id,
        prefix=row.prefix,
        tenant=row.tenant,
        feature=row.feature,
        name=row.name,
        policy=dict(row.policy or {}),
        created_at=row.created_at,
        revoked_at=row.revoked_at,
    )


async def create_key(
    engine: AsyncEngine, *, tenant: str, feature: str, name: str = "", policy: Mapping[str, Any] | None = None
) -> CreatedKey:
    _check_text(tenant, "tenant", 128)
    _check_text(feature, "feature", 128)
    if name:
        _check_text(name, "name", 256)
    overrides = validate_policy_overrides(policy or {})
    secret = new_secret()
    key = ApiKey(
        id=str(uuid.uuid4()),
        prefix=secret[:DISPLAY_PREFIX_LEN],
        tenant=tenant,
        feature=feature,
        name=name,
        policy=overrides,
        created_at=datetime.now(UTC),
    )
    async with engine.begin() as connection:
        await connection.execute(
            api_keys.insert().values(
                id=key.id,
                key_hash=hash_secret(secret),
                prefix=key.prefix,
                tenant=tenant,
                feature=feature,
                name=name,
                policy=overrides,
                created_at=key.created_at,
            )
        )
    return CreatedKey(key=key, secret=secret)


async def list_keys(engine: AsyncEngine, *, tenant: str | None = None, include_revoked: bool = True) -> list[ApiKey]:
    query = sa.select(api_keys).order_by(api_keys.c.created_at, api_keys.c.id)
    if tenant is not None:
        _check_text(tenant, "tenant", 128)
        query = query.where(api_keys.c.tenant == tenant)
    if not include_revoked:
        query = query.where(api_keys.c.revoked_at.is_(None))
    async with engine.connect() as connection:
        rows = (await connection.execute(query)).all()
    return [_row_to_key(row) for row in rows]


async def revoke_key(engine: AsyncEngine, key_id: str) -> bool:
    """Revoke an active key; False when no active key has this id."""
    if not key_id.isprintable() or len(key_id) > 36:
        return False
    async with engine.begin() as connection:
        result = await connection.execute(
            api_keys.update()
            .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
    return result.rowcount == 1


async def update_key_policy(engine: AsyncEngine, key_id: str, changes: Mapping[str, Any]) -> ApiKey | None:
    """Set policy overrides of an active key; a None value removes that override (the feature's policy
    applies again). Returns the updated key, or None when no active key has this id."""
    if not key_id.isprintable() or len(key_id) > 36:
        return None
    set_values = validate_policy_overrides({name: value for name, value in changes.items() if value is not None})
    removed = {name for name, value in changes.items() if value is None}
    unknown = removed - set(PolicyConfig.__struct_fields__)
    if unknown:
        raise InvalidPolicy(f"policy: unknown field(s) {sorted(unknown)}")
    async with engine.begin() as connection:
        query = sa.select(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)).with_for_update()
        row = (await connection.execute(query)).first()
        if row is None:
            return None
        policy = {name: value for name, value in (row.policy or {}).items() if name not in removed} | set_values
        await connection.execute(api_keys.update().where(api_keys.c.id == key_id).values(policy=policy))
    return dataclasses.replace(_row_to_key(row), policy=policy)
async def active_prefixes(engine: AsyncEngine) -> set[str]:
    query = sa.select(api_keys.c.prefix).where(api_keys.c.revoked_at.is_(None)).distinct()
    async with engine.connect() as connection:
        return set((await connection.execute(query)).scalars())


async def find_active_key(engine: AsyncEngine, secret: str) -> ApiKey | None:
    query = sa.select(api_keys).where(api_keys.c.key_hash == hash_secret(secret), api_keys.c.revoked_at.is_(None))
    async with engine.connect() as connection:
        row = (await connection.execute(query)).first()
    return _row_to_key(row) if row is not None else None


async def active_key_by_id(engine: AsyncEngine, key_id: str) -> ApiKey | None:
    """The key with this id unless it was revoked (work done later on a key's behalf: batch lines)."""
    query = sa.select(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
    async with engine.connect() as connection:
        row = (await connection.execute(query)).first()
    return _row_to_key(row) if row is not None else None


@dataclass(slots=True)
class KeyCache:
    """Secret → active key (or None), each remembered for `ttl_s` seconds, then refreshed in the
    background while the last answer still serves (stale-while-revalidate), and kept for as long as
    the database is unreachable."""

    engine: AsyncEngine
    ttl_s: float = DEFAULT_KEY_CACHE_TTL_S
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, tuple[float, ApiKey | None]] = field(default_factory=dict)
    _refreshing: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _prefixes: set[str] = field(default_factory=set)
    _prefixes_read_at: float = float("-inf")
    _prefix_reads: int = 0  # reads begun
    _reading_prefixes: asyncio.Task[None] | None = None

    async def lookup(self, secret: str) -> ApiKey | None:
        if _SECRET_SHAPE.fullmatch(secret) is None:
            return None  # no key has this shape: nothing to read
        digest = hash_secret(secret)  # the cache, too, holds no plain secrets
        entry = self._entries.get(digest)
        if entry is not None:
            if entry[0] <= self.clock() and digest not in self._refreshing:
                task = asyncio.create_task(self._refresh(secret, digest), name="key-cache-refresh")
                self._refreshing[digest] = task
                task.add_done_callback(lambda _: self._refreshing.pop(digest, None))
            return entry[1]
        try:
            if not await self._prefix_is_active(secret[:DISPLAY_PREFIX_LEN]):
                return None
            key = await find_active_key(self.engine, secret)
        except (sa.exc.SQLAlchemyError, OSError) as exc:
            raise KeyStoreUnavailable(str(exc)) from exc
        self._remember(digest, key)
        return key

    async def _prefix_is_active(self, prefix: str) -> bool:
        """Whether an active key has this prefix, as of a read made after this call began."""
        seen = self._prefix_reads
        while prefix not in self._prefixes and self._prefix_reads == seen:  # no read begun since we came
            if self._reading_prefixes is None or self._reading_prefixes.done():
                self._reading_prefixes = asyncio.create_task(self._read_prefixes(), name="key-prefixes")
            await asyncio.shield(self._reading_prefixes)  # one caller leaving does not cancel the others' read
        return prefix in self._prefixes

    async def _read_prefixes(self) -> None:
        wait = self._prefixes_read_at + PREFIX_REFRESH_S - self.clock()
        if wait > 0:
            await asyncio.sleep(min(wait, PREFIX_REFRESH_S))
        self._prefixes_read_at = self.clock()
        self._prefix_reads += 1
        self._prefixes = await active_prefixes(self.engine)

    async def refreshed(self) -> None:
        """Wait for the background refreshes under way (tests; shutdown)."""
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)

    async def aclose(self) -> None:
        tasks = [t for t in (*self._refreshing.values(), self._reading_prefixes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def forget(self, key_id: str) -> None:
        """Drop a key at once (it was revoked through this replica)."""
        self._entries = {d: e for d, e in self._entries.items() if e[1] is None or e[1].id != key_id}

    async def _refresh(self, secret: str, digest: str) -> None:
        try:
            key = await find_active_key(self.engine, secret)
        except (sa.exc.SQLAlchemyError, OSError) as exc:
            # The database is down: keep answering as we last knew, and ask again after a TTL.
            logger.warning("key store unreachable, serving cached keys: %s", exc)
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries[digest] = (self.clock() + self.ttl_s, entry[1])
            return
        if digest in self._entries:  # not forgotten meanwhile
            self._remember(digest, key)

    def _remember(self, digest: str, key: ApiKey | None) -> None:
        now = self.clock()
        if len(self._entries) >= _MAX_CACHED_SECRETS:
            self._entries = {d: e for d, e in self._entries.items() if e[0] > now}
        self._entries[digest] = (now + self.ttl_s, key)
