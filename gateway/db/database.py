"""The one way to open the database: an async SQLAlchemy engine for Postgres or an SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

SQLITE_BUSY_TIMEOUT_MS = 5000


def is_sqlite(url: str | sa.URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str | sa.URL) -> Path | None:
    """The database file of an SQLite URL; None for in-memory databases."""
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database).expanduser()


def _set_sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the dashboard read while the accounting writer writes; the busy timeout makes a
    # second writer (CLI, another process) wait instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_database(url: str, *, pool_size: int = 5, echo: bool = False) -> AsyncEngine:
    """An async engine for `postgresql+asyncpg://…` or `sqlite+aiosqlite:///path`.

    Postgres gets a pool of `pool_size` connections (`database.pool_size` in the config) that
    checks connections before use, so a restarted server is picked up without errors. SQLite gets
    its parent directory created, WAL mode and a busy timeout.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        path = sqlite_path(parsed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(parsed, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        sa.event.listen(engine.sync_engine, "connect", _set_sqlite_pragmas)
        return engine
    if backend == "postgresql":
        return create_async_engine(
            parsed,
            echo=echo,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            pool_recycle=1800,
            connect_args={"timeout": 5, "command_timeout": 30},
        )
    raise ValueError(
        f"database.url: unsupported database {backend!r}; use postgresql+asyncpg:// or sqlite+aiosqlite://"
    )
