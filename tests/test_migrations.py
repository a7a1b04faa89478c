"""Migrations build exactly `gateway.db.schema`, on Postgres and SQLite, and undo cleanly."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from gateway.db import migrate
from gateway.db.database import make_database, sqlite_path
from gateway.db.schema import metadata

TABLES = {
    "api_keys",
    "requests",
    "daily_usage",
    "hourly_usage",
    "key_hourly_usage",
    "daily_errors",
    "router_versions",
    "eval_runs",
    "shadow_runs",
    "files",
    "batches",
    "batch_lines",
}


def _same_literal_default(
    _context: object,
    _inspected_column: object,
    _metadata_column: object,
    inspected_default: str | None,
    _metadata_default: object,
    rendered_metadata_default: str | None,
) -> bool | None:
    # SQLite reflects the declared "" as "('')", which Alembic alone reports as a change. Equal
    # literals are the same default; anything else is left to Alembic's own comparison.
    def literal(text: str | None) -> str | None:
        return None if text is None else text.strip().strip("()").strip("'")

    if inspected_default is not None and literal(inspected_default) == literal(rendered_metadata_default):
        return False
    return None


def _schema_diff(connection: sa.Connection, declared: sa.MetaData = metadata) -> list[object]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "compare_server_default": _same_literal_default}
    )
    return compare_metadata(context, declared)


async def _table_names(url: str) -> set[str]:
    engine = make_database(url)
    try:
        async with engine.connect() as connection:
            names = await connection.run_sync(lambda sync: sa.inspect(sync).get_table_names())
    finally:
        await engine.dispose()
    return set(names) - {"alembic_version"}


async def _diff(url: str, declared: sa.MetaData = metadata) -> list[object]:
    engine = make_database(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(_schema_diff, declared)
    finally:
        await engine.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("empty_postgres_url" if request.param == "postgres" else "empty_sqlite_url")


def test_there_is_exactly_one_head() -> None:
    assert migrate.head_revision() == "0004"


async def test_upgrade_creates_the_schema_exactly_as_declared(empty_url: str) -> None:
    assert await migrate.current_async(empty_url) is None
    await migrate.upgrade_async(empty_url)
    assert await migrate.current_async(empty_url) == migrate.head_revision()
    assert await _table_names(empty_url) == TABLES
    assert await _diff(empty_url) == []


async def test_downgrade_to_base_removes_every_table_and_upgrade_rebuilds_them(empty_url: str) -> None:
    await migrate.upgrade_async(empty_url)
    await migrate.downgrade_async(empty_url, "base")
    assert await migrate.current_async(empty_url) is None
    assert await _table_names(empty_url) == set()
    await migrate.upgrade_async(empty_url)
    assert await _table_names(empty_url) == TABLES
    assert await _diff(empty_url) == []


async def test_an_unmigrated_database_differs_from_the_schema(empty_url: str) -> None:
    # Guards the check above: compare_metadata must see missing tables, or an empty diff proves nothing.
    assert {diff[0] for diff in await _diff(empty_url)} == {"add_table", "add_index"}


async def test_a_changed_default_or_type_is_reported_as_a_difference(empty_url: str) -> None:
    # Guards the comparison of defaults and types: it must not hide a real change.
    await migrate.upgrade_async(empty_url)
    changed = sa.MetaData(naming_convention=metadata.naming_convention)
    for table in metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables["requests"].c.cache_status.server_default = sa.DefaultClause("exact")
    changed.tables["requests"].c.error_code.type = sa.String(128)
    kinds = {diff[0][0] for diff in await _diff(empty_url, changed)}
    assert kinds == {"modify_default", "modify_type"}


def test_sync_functions_work_without_an_event_loop(empty_sqlite_url: str) -> None:
    migrate.upgrade(empty_sqlite_url)
    assert migrate.current(empty_sqlite_url) == migrate.head_revision()
    migrate.downgrade(empty_sqlite_url, "base")
    assert migrate.current(empty_sqlite_url) is None


async def test_sync_functions_also_work_inside_a_running_event_loop(empty_sqlite_url: str) -> None:
    migrate.upgrade(empty_sqlite_url)
    assert migrate.current(empty_sqlite_url) == migrate.head_revision()


async def test_sqlite_database_gets_its_directory_created_and_wal_mode(empty_sqlite_url: str) -> None:
    path = sqlite_path(empty_sqlite_url)
    assert path is not None and not path.parent.exists()
    engine = make_database(empty_sqlite_url)
    try:
        async with engine.connect() as connection:
            journal_mode = (await connection.execute(sa.text("PRAGMA journal_mode"))).scalar()
            busy_timeout = (await connection.execute(sa.text("PRAGMA busy_timeout"))).scalar()
    finally:
        await engine.dispose()
    assert path.exists()
    assert journal_mode == "wal"
    assert busy_timeout and busy_timeout > 0


def test_an_unsupported_database_url_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="unsupported database"):
        make_database("mysql+aiomysql://localhost/x")
