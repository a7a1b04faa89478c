"""Virtual keys: hashed storage, create/list/revoke, policy overrides, and the auth cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.db.database import make_database
from gateway.db.schema import api_keys
from gateway.keys import (
    SECRET_PREFIX,
    InvalidPolicy,
    KeyCache,
    KeyStoreUnavailable,
    create_key,
    effective_policy,
    hash_secret,
    list_keys,
    revoke_key,
)
from tests.gateway.conftest import make_settings


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_database(postgres_url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_a_created_key_is_stored_only_as_its_sha256(db: AsyncEngine):
    created = await create_key(db, tenant="acme", feature="search", name="ci")
    assert created.secret.startswith(SECRET_PREFIX) and len(created.secret) > 40
    async with db.connect() as connection:
        row = (await connection.execute(sa.select(api_keys).where(api_keys.c.id == created.key.id))).one()
    assert row.key_hash == hash_secret(created.secret)
    assert created.secret not in {str(value) for value in row}
    assert row.prefix == created.secret[: len(row.prefix)]


async def test_keys_are_listed_per_tenant_and_revoked_keys_can_be_hidden(db: AsyncEngine):
    tenant = f"tenant-{id(db)}"
    kept = await create_key(db, tenant=tenant, feature="chat")
    gone = await create_key(db, tenant=tenant, feature="chat")
    assert await revoke_key(db, gone.key.id)
    assert not await revoke_key(db, gone.key.id)  # already revoked
    listed = await list_keys(db, tenant=tenant)
    assert [k.id for k in listed] == [kept.key.id, gone.key.id]
    assert listed[1].revoked_at is not None
    assert [k.id for k in await list_keys(db, tenant=tenant, include_revoked=False)] == [kept.key.id]


async def test_policy_overrides_are_validated_and_take_precedence_over_the_feature_policy(db: AsyncEngine):
    with pytest.raises(InvalidPolicy):
        await create_key(db, tenant="acme", feature="chat", policy={"rpm": "many"})
    with pytest.raises(InvalidPolicy):
        await create_key(db, tenant="acme", feature="chat", policy={"no_such_field": 1})
    created = await create_key(db, tenant="acme", feature="chat", policy={"rpm": 7})
    policy = effective_policy(make_settings(max_output_tokens=99, rpm=1000), "chat", created.key.policy)
    assert (policy.rpm, policy.max_output_tokens) == (7, 99)


async def test_the_auth_cache_reads_the_database_once_per_ttl_and_sees_a_revocation_after_it(db: AsyncEngine):
    clock = [1000.0]
    cache = KeyCache(db, ttl_s=2.0, clock=lambda: clock[0])
    created = await create_key(db, tenant="acme", feature="chat")
    assert (await cache.lookup(created.secret)).id == created.key.id
    await revoke_key(db, created.key.id)  # through another replica: this cache is not told
    clock[0] += 1.9
    assert await cache.lookup(created.secret) is not None  # still within the TTL
    clock[0] += 0.2
    # Expired: the last answer serves this one request while one background read refreshes it.
    assert await cache.lookup(created.secret) is not None
    await cache.refreshed()
    assert await cache.lookup(created.secret) is None  # revoked, 2 s and one read after it was last read


async def test_an_expired_key_is_refreshed_by_one_read_however_many_requests_arrive(db: AsyncEngine):
    clock = [1000.0]
    cache = KeyCache(db, ttl_s=2.0, clock=lambda: clock[0])
    created = await create_key(db, tenant="acme", feature="chat")
    await cache.lookup(created.secret)
    clock[0] += 5
    answers = await asyncio.gather(*(cache.lookup(created.secret) for _ in range(20)))
    assert {answer.id for answer in answers} == {created.key.id}
    assert len(cache._refreshing) == 1
    await cache.refreshed()
    assert not cache._refreshing


async def test_forgetting_a_key_takes_effect_at_once(db: AsyncEngine):
    cache = KeyCache(db, ttl_s=60.0)
    created = await create_key(db, tenant="acme", feature="chat")
    await cache.lookup(created.secret)
    await revoke_key(db, created.key.id)
    cache.forget(created.key.id)
    assert await cache.lookup(created.secret) is None


async def test_while_the_database_is_down_cached_keys_still_authenticate_and_others_fail_clearly(db: AsyncEngine):
    clock = [1000.0]
    cache = KeyCache(db, ttl_s=2.0, clock=lambda: clock[0])
    created = await create_key(db, tenant="acme", feature="chat")
    await cache.lookup(created.secret)
    down = make_database("postgresql+asyncpg://postgres@127.0.0.1:1/none")  # nothing listens on port 1
    try:
        cache.engine = down
        clock[0] += 60
        assert (await cache.lookup(created.secret)).id == created.key.id
        await cache.refreshed()  # the refresh fails: the key keeps authenticating
        assert (await cache.lookup(created.secret)).id == created.key.id
        assert not cache._refreshing  # and the next refresh waits a TTL rather than hammering the database
        with pytest.raises(KeyStoreUnavailable):
            await cache.lookup(SECRET_PREFIX + "never-seen")
    finally:
        await down.dispose()


async def test_an_unknown_secret_is_none(db: AsyncEngine):
    assert await KeyCache(db).lookup(SECRET_PREFIX + "nope") is None
