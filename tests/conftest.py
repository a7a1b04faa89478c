"""Shared fixtures: real PostgreSQL, SQLite and Redis, isolated per test run (never mocks).

`SLUICE_TEST_POSTGRES_URL` names the server (and a database on it to connect to for
`CREATE DATABASE`); each run creates its own uniquely named database there. `SLUICE_TEST_REDIS_URL`
names the Redis database; tests isolate themselves with `redis_prefix`. `SLUICE_TEST_REDIS8_URL` names a
Redis with vector sets (8+; `.ci/services.sh` starts Debian's on port 6380 when it can): the tests of the
cache's vector-set path skip, saying so, without one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from gateway.db.migrate import upgrade_async

POSTGRES_ADMIN_URL = os.environ.get("SLUICE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS8_URL = os.environ.get("SLUICE_TEST_REDIS8_URL", "redis://127.0.0.1:6380/0")


@contextlib.asynccontextmanager
async def _new_postgres_database(*, migrated: bool) -> AsyncIterator[str]:
    admin_url = sa.make_url(POSTGRES_ADMIN_URL)
    if admin_url.drivername == "postgresql":
        admin_url = admin_url.set(drivername="postgresql+asyncpg")
    admin = create_async_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    name = f"sluice_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        async with admin.connect() as connection:
            await connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except (OSError, sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        await admin.dispose()
        pytest.fail(
            f"PostgreSQL is not reachable at {admin_url.render_as_string(hide_password=True)} ({exc}). "
            "`make test` starts it; or point SLUICE_TEST_POSTGRES_URL at a running server.",
            pytrace=False,
        )
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    try:
        if migrated:
            await upgrade_async(url)
        yield url
    finally:
        async with admin.connect() as connection:
            await connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()


@pytest.fixture(scope="session")
async def postgres_url() -> AsyncIterator[str]:
    """A migrated database shared by this test run (tests keep apart by their own ids); dropped at the end."""
    async with _new_postgres_database(migrated=True) as url:
        yield url


@pytest.fixture
async def empty_postgres_url() -> AsyncIterator[str]:
    """A database with no tables, private to the test (for migration and CLI tests)."""
    async with _new_postgres_database(migrated=False) as url:
        yield url


@pytest.fixture
def empty_sqlite_url(tmp_path: Path) -> str:
    """An SQLite URL whose file does not exist yet, private to the test."""
    return f"sqlite+aiosqlite:///{tmp_path / 'db' / 'sluice.db'}"


@pytest.fixture
async def sqlite_url(empty_sqlite_url: str) -> str:
    """A migrated SQLite database file private to the test."""
    await upgrade_async(empty_sqlite_url)
    return empty_sqlite_url


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({exc}). "
            "`make test` starts it; or point SLUICE_TEST_REDIS_URL at a running server.",
            pytrace=False,
        )
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def redis8_url() -> str:
    client = redis.Redis.from_url(REDIS8_URL)
    try:
        client.execute_command("VCARD", "sluice-test:probe")
    except redis.RedisError as exc:
        pytest.skip(f"no Redis with vector sets at {REDIS8_URL} ({exc}): `.ci/services.sh` starts one on port 6380 "
                    "when Debian's Redis 8 can be fetched; or point SLUICE_TEST_REDIS8_URL at a running server")
    finally:
        client.close()
    return REDIS8_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix unique to the test; its keys are deleted afterwards."""
    prefix = f"sluice-test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
