"""The SQL writer: a batch of records into `requests`, and their rollups into `daily_usage`, in one
transaction (on Postgres one statement, one round trip). Idempotent: a row already present is
neither inserted nor counted again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.accounting.record import (
    ERRORS_KEY,
    HISTOGRAM_COLUMNS,
    HOURLY_KEY,
    KEY_USAGE_COUNTERS,
    KEY_USAGE_KEY,
    RECORD_FIELDS,
    ROLLUP_COUNTERS,
    ROLLUP_KEY,
    RequestRecord,
    as_utc,
    error_deltas,
    hourly_deltas,
    key_usage_deltas,
    latency_buckets,
    rollup_contribution,
    rollup_deltas,
)
from gateway.db.schema import daily_errors, daily_usage, hourly_usage, key_hourly_usage, requests

logger = logging.getLogger("gateway.accounting")

def _insert(connection: AsyncConnection, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
    dialect = connection.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"accounting supports postgresql and sqlite, not {dialect}")


def _postgres_rollup_cte(name: str, table: sa.Table, key: Sequence[str], sums: Sequence[str], where: str = "") -> str:
    """A CTE of the write statement adding the inserted rows' contributions to one rollup table; `sums`
    are summed, histogram columns counted by bucket."""
    histograms = [column for column in HISTOGRAM_COLUMNS if column in table.c]
    bucket_counts = [f"count(*) FILTER (WHERE {column[:-4]}_bucket = {int(column[-2:])})" for column in histograms]
    columns = (*sums, *histograms)
    keys = ", ".join(key)
    return (
        f"{name} AS (INSERT INTO {table.name} ({keys}, {', '.join(columns)})"
        f" SELECT {keys}, {', '.join([f'sum({column})' for column in sums] + bucket_counts)}"
        f" FROM contributions JOIN inserted USING (request_id){where} GROUP BY {keys}"
        f" ON CONFLICT ({keys}) DO UPDATE SET "
        + ", ".join(f"{column} = {table.name}.{column} + EXCLUDED.{column}" for column in columns)
        + ")"
    )


def _postgres_write_batch_sql() -> str:
    """One statement: insert the rows not already present, and add the contributions of exactly the
    inserted ones to their rollups. One statement is one transaction and one round trip. Rows and
    contributions travel as two JSON parameters (msgspec encodes a row in about a microsecond;
    binding typed values costs the event loop far more), read back with the tables' own types."""
    contribution_types = ", ".join(
        f"{column.name} {column.type.compile(dialect=postgresql.dialect())}"
        for column in (
            requests.c.request_id,
            *(daily_usage.c[name] for name in (*ROLLUP_KEY, *ROLLUP_COUNTERS)),
            hourly_usage.c.hour,
            key_hourly_usage.c.key_id,
            daily_errors.c.status,
            daily_errors.c.error_code,
        )
    )
    contribution_types += ", ttft_bucket integer, itl_bucket integer"
    return (
        f"WITH inserted AS (INSERT INTO requests ({', '.join(RECORD_FIELDS)})"
        f" SELECT {', '.join(RECORD_FIELDS)} FROM json_populate_recordset(NULL::requests, $1::json)"
        " ON CONFLICT (request_id) DO NOTHING RETURNING request_id),"
        f" contributions AS (SELECT * FROM json_to_recordset($2::json) AS c({contribution_types})), "
        + _postgres_rollup_cte("rolled_up", daily_usage, ROLLUP_KEY, ROLLUP_COUNTERS)
        + ", "
        + _postgres_rollup_cte("hourly_rolled_up", hourly_usage, HOURLY_KEY, ROLLUP_COUNTERS)
        + ", "
        + _postgres_rollup_cte(
            "keys_rolled_up", key_hourly_usage, KEY_USAGE_KEY, KEY_USAGE_COUNTERS, " WHERE key_id <> ''"
        )
        + ", "
        + _postgres_rollup_cte("errors_rolled_up", daily_errors, ERRORS_KEY, ("requests",), " WHERE status >= 400")
        + " SELECT count(*) FROM inserted"
    )


_POSTGRES_WRITE_BATCH = _postgres_write_batch_sql()
# One request's rollup contribution as sent to Postgres (a struct: msgspec encodes it in well under a µs).
_Contribution = msgspec.defstruct(
    "_Contribution",
    [
        ("request_id", str),
        *((name, Any) for name in (*ROLLUP_KEY, *ROLLUP_COUNTERS)),
        ("hour", datetime),
        ("key_id", str),
        ("status", int),
        ("error_code", str),
        ("ttft_bucket", int),
        ("itl_bucket", int),
    ],
)
_json_encoder = msgspec.json.Encoder()


def _with_offset(record: RequestRecord) -> RequestRecord:
    """A naive `created_at` is UTC (`as_utc`); sent without an offset, the server would read it in
    its own time zone."""
    if record.created_at.tzinfo is not None:
        return record
    return dataclasses.replace(record, created_at=as_utc(record.created_at))


def _contribution(record: RequestRecord) -> Any:
    key, counts = rollup_contribution(record)
    return _Contribution(
        record.request_id,
        *key,
        *counts,
        record.hour,
        record.key_id or "",
        record.status,
        record.error_code or "",
        *latency_buckets(record),
    )


async def _write_batch_postgres(connection: AsyncConnection, records: Sequence[RequestRecord]) -> int:
    """The Postgres path, on the asyncpg connection itself: one prepared statement, no BEGIN/COMMIT,
    no SQL built per batch (the SQLAlchemy path costs milliseconds per batch)."""
    rows = _json_encoder.encode([_with_offset(record) for record in records])
    contributions = _json_encoder.encode([_contribution(record) for record in records])
    driver = (await connection.get_raw_connection()).driver_connection
    assert driver is not None
    try:
        return int(await driver.fetchval(_POSTGRES_WRITE_BATCH, rows.decode(), contributions.decode()))
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise sa.exc.IntegrityError(_POSTGRES_WRITE_BATCH, None, exc) from exc
    except asyncpg.DataError as exc:
        raise sa.exc.DataError(_POSTGRES_WRITE_BATCH, None, exc) from exc


async def write_batch(target: AsyncEngine | AsyncConnection, records: Sequence[RequestRecord]) -> int:
    """Insert `records` and add the ones not already present to `daily_usage`, in one transaction.
    Returns how many rows were new. `target`: an engine (a pooled connection for this call), or a
    connection the caller holds and that is not in a transaction."""
    if not records:
        return 0
    by_id = {record.request_id: record for record in records}
    if isinstance(target, AsyncEngine):
        async with target.connect() as connection:
            return await _write_batch(connection, by_id)
    return await _write_batch(target, by_id)


async def _write_batch(connection: AsyncConnection, by_id: dict[str, RequestRecord]) -> int:
    if connection.dialect.name == "postgresql":
        return await _write_batch_postgres(connection, list(by_id.values()))
    async with connection.begin():
        # An executemany with RETURNING is sent as multi-row INSERTs ("insertmanyvalues") from one
        # cached compiled statement; compiling a literal multi-row VALUES costs far more, per row.
        insert = _insert(connection, requests)
        statement = insert.on_conflict_do_nothing(index_elements=[requests.c.request_id]).returning(
            requests.c.request_id
        )
        result = await connection.execute(statement, [record.row() for record in by_id.values()])
        inserted_ids = list(result.scalars())
        inserted = [by_id[request_id] for request_id in inserted_ids]
        if inserted:
            for table, key, deltas in (
                (daily_usage, ROLLUP_KEY, rollup_deltas(inserted)),
                (hourly_usage, HOURLY_KEY, hourly_deltas(inserted)),
                (key_hourly_usage, KEY_USAGE_KEY, key_usage_deltas(inserted)),
                (daily_errors, ERRORS_KEY, error_deltas(inserted)),
            ):
                if deltas:
                    await connection.execute(_sqlite_upsert(connection, table, key), deltas)
    return len(inserted_ids)


def _sqlite_upsert(connection: AsyncConnection, table: sa.Table, key: Sequence[str]) -> sqlite.Insert:
    upsert = _insert(connection, table)
    return upsert.on_conflict_do_update(
        index_elements=[table.c[name] for name in key],
        set_={column.name: column + upsert.excluded[column.name] for column in table.c if column.name not in key},
    )
