"""Schema migrations: Alembic configured in code (no alembic.ini), scripts in `migrations/`.

The async functions run on an `AsyncEngine` (or URL); the sync wrappers are what the CLI calls
(`sluice db upgrade|downgrade|current`) and also work when called from inside a running event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.db.database import make_database

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"

_T = TypeVar("_T")


def alembic_config(url: str = "") -> Config:
    """Alembic's configuration for our `migrations/` folder. A connection, when Alembic should use
    one, is passed in `config.attributes["connection"]` (see migrations/env.py)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        # ConfigParser interpolates %; a password may contain it.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def _with_connection(engine_or_url: AsyncEngine | str, work: Callable[[sa.Connection], _T]) -> _T:
    engine = make_database(engine_or_url) if isinstance(engine_or_url, str) else engine_or_url
    try:
        async with engine.begin() as connection:
            return await connection.run_sync(work)
    finally:
        if isinstance(engine_or_url, str):
            await engine.dispose()


def _alembic_command(name: str, revision: str) -> Callable[[sa.Connection], None]:
    def run(connection: sa.Connection) -> None:
        config = alembic_config()
        config.attributes["connection"] = connection
        getattr(command, name)(config, revision)

    return run


def _current_revision(connection: sa.Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def upgrade_async(engine_or_url: AsyncEngine | str, revision: str = "head") -> None:
    await _with_connection(engine_or_url, _alembic_command("upgrade", revision))


async def downgrade_async(engine_or_url: AsyncEngine | str, revision: str) -> None:
    await _with_connection(engine_or_url, _alembic_command("downgrade", revision))


async def current_async(engine_or_url: AsyncEngine | str) -> str | None:
    return await _with_connection(engine_or_url, _current_revision)


def _run(coroutine: Coroutine[Any, Any, _T]) -> _T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Inside a running loop (a test, a notebook) asyncio.run is not allowed: use a fresh thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (default: the latest)."""
    _run(upgrade_async(url, revision))


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at `url` down to `revision` ("base" removes every table)."""
    _run(downgrade_async(url, revision))


def current(url: str) -> str | None:
    """The revision the database at `url` is at; None for a database never migrated."""
    return _run(current_async(url))
