"""The SQL writer: a batch of records into `requests`, and their rollups into `daily_usage`, in one
transaction (on Postgres one statement, one round trip). Idempotent: a row already present is
neither inserted nor counted again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import asyncpg
import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.accounting.record import (
    RECORD_FIELDS,
    ROLLUP_COUNTERS,
    ROLLUP_KEY,
    RequestRecord,
    as_utc,
    rollup_contribution,
    rollup_deltas,
)
from gateway.db.schema import daily_usage, requests

logger = logging.getLogger("gateway.accounting")

def _insert(connection: AsyncConnection, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
    dialect = connection.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"accounting supports postgresql and sqlite, not {dialect}")


def _postgres_write_batch_sql() -> str:
    """One statement: insert the rows not already present, and add the contributions of exactly the
    inserted ones to their rollups. One statement is one transaction and one round trip. Rows and
    contributions travel as two JSON parameters (msgspec encodes a row in about a microsecond;
    binding typed values costs the event loop far more), read back with the tables' own types."""
    key = ", ".join(ROLLUP_KEY)
    counters = ", ".join(ROLLUP_COUNTERS)
    contribution_types = ", ".join(
        f"{column.name} {column.type.compile(dialect=postgresql.dialect())}"
        for column in (requests.c.request_id, *(daily_usage.c[name] for name in (*ROLLUP_KEY, *ROLLUP_COUNTERS)))
    )
    return (
        f"WITH inserted AS (INSERT INTO requests ({', '.join(RECORD_FIELDS)})"
        f" SELECT {', '.join(RECORD_FIELDS)} FROM json_populate_recordset(NULL::requests, $1::json)"
        " ON CONFLICT (request_id) DO NOTHING RETURNING request_id),"
        f" contributions AS (SELECT * FROM json_to_recordset($2::json) AS c({contribution_types})),"
        f" rolled_up AS (INSERT INTO daily_usage ({key}, {counters})"
        f" SELECT {key}, {', '.join(f'sum({name})' for name in ROLLUP_COUNTERS)}"
        f" FROM contributions JOIN inserted USING (request_id) GROUP BY {key}"
        f" ON CONFLICT ({key}) DO UPDATE SET "
        + ", ".join(f"{name} = daily_usage.{name} + EXCLUDED.{name}" for name in ROLLUP_COUNTERS)
        + ") SELECT count(*) FROM inserted"
    )


_POSTGRES_WRITE_BATCH = _postgres_write_batch_sql()
# One request's rollup contribution as sent to Postgres (a struct: msgspec encodes it in well under a µs).
_Contribution = msgspec.defstruct(
    "_Contribution", [("request_id", str), *((name, Any) for name in (*ROLLUP_KEY, *ROLLUP_COUNTERS))]
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
    return _Contribution(record.request_id, *key, *counts)


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
        deltas = rollup_deltas(by_id[request_id] for request_id in inserted_ids)
        if deltas:
            upsert = _insert(connection, daily_usage)
            upsert = upsert.on_conflict_do_update(
                index_elements=[daily_usage.c.day, daily_usage.c.tenant, daily_usage.c.feature, daily_usage.c.tier],
                set_={name: daily_usage.c[name] + upsert.excluded[name] for name in ROLLUP_COUNTERS},
            )
            await connection.execute(upsert, deltas)
    return len(inserted_ids)
