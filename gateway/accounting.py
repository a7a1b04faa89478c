"""Request accounting off the request path: one `requests` row per request plus `daily_usage` rollups.

The gateway builds a `RequestRecord` per request and calls `AccountingWriter.submit`, which only
appends to an in-memory queue. A background task writes batches: a multi-row INSERT … ON CONFLICT
(request_id) DO NOTHING RETURNING request_id, and the rollup upsert for exactly the rows returned, in
one transaction (on Postgres one prepared statement with one array parameter per column, so a flush
is one round trip whatever its size). Replaying a batch is therefore idempotent: rows already
present are neither inserted again nor counted again.

When the database is unreachable, batches go to a bounded spool of append-only JSONL segments
(fsync'd) and are replayed, oldest first, once it is back; a segment is deleted only after all its
rows are committed. `close()` writes or spools everything still queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg
import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.db.schema import daily_usage, requests

logger = logging.getLogger(__name__)

# daily_usage.tier is part of the primary key; requests no tier served (cache hits, rejections)
# are rolled up under this name.
NO_TIER = ""
CACHE_HIT_STATUSES = frozenset({"exact", "semantic"})
HELD_CONNECTION_IDLE_S = 60.0  # the writer's Postgres connection is replaced after this long unused
ROLLUP_COUNTERS = (
    "requests",
    "errors",
    "escalations",
    "cache_hits",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "semantic_cache_hits",
    "cost_saved_usd",
)


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _as_utc(moment: datetime) -> datetime:
    """Naive datetimes are taken as UTC (SQLite hands them back without offset)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@dataclasses.dataclass(kw_only=True, slots=True)
class RequestRecord:
    """One row of `requests`: what happened to one request, as the gateway saw it."""

    request_id: str
    created_at: datetime = dataclasses.field(default_factory=_utc_now)
    tenant: str
    feature: str
    key_id: str | None = None
    endpoint: str = "chat"  # chat | completions
    model_requested: str = ""
    route: str | None = None  # tier the router chose
    route_score: float | None = None
    tier: str | None = None  # tier that served; None when none did (cache hit, rejected)
    escalated: bool = False
    fallback: bool = False
    confidence: float | None = None
    cache_status: str = "miss"  # miss | exact | semantic | off
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    itl_ms_mean: float | None = None
    status: int = 200  # HTTP status returned
    error_code: str | None = None
    cache_similarity: float | None = None  # of a semantic hit
    cost_saved_usd: float = 0.0  # what a cache hit saved: the cost of generating the answer
    used_tools: bool = False
    response_format: str | None = None  # json_object | json_schema
    priority: str = "interactive"  # interactive | batch

    def row(self) -> dict[str, Any]:
        """The `requests` row; `created_at` normalised to UTC (SQLite stores it without offset)."""
        values = {name: getattr(self, name) for name in _RECORD_FIELDS}
        values["created_at"] = _as_utc(self.created_at)
        return values

    @property
    def day(self) -> date:
        """The UTC day the request is accounted to."""
        return _as_utc(self.created_at).date()


_RECORD_FIELDS = tuple(field.name for field in dataclasses.fields(RequestRecord))


_ROLLUP_KEY = ("day", "tenant", "feature", "tier")


def rollup_contribution(record: RequestRecord) -> tuple[tuple[date, str, str, str], tuple[int | float, ...]]:
    """The `daily_usage` row `record` counts towards, and what it adds to each of ROLLUP_COUNTERS."""
    key = (record.day, record.tenant, record.feature, record.tier or NO_TIER)
    counts = (
        1,
        int(record.status >= 400),
        int(record.escalated),
        int(record.cache_status in CACHE_HIT_STATUSES),
        record.prompt_tokens,
        record.completion_tokens,
        record.cached_tokens,
        float(record.cost_usd),
        int(record.cache_status == "semantic"),
        float(record.cost_saved_usd),
    )
    return key, counts


def rollup_deltas(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """What `records` add to `daily_usage`, one entry per (day, tenant, feature, tier)."""
    sums: dict[tuple[date, str, str, str], list[int | float]] = {}
    for record in records:
        key, counts = rollup_contribution(record)
        total = sums.get(key)
        if total is None:
            sums[key] = list(counts)
        else:
            for index, count in enumerate(counts):
                total[index] += count
    return [
        dict(zip(_ROLLUP_KEY, key, strict=True)) | dict(zip(ROLLUP_COUNTERS, total, strict=True))
        for key, total in sums.items()
    ]


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
    key = ", ".join(_ROLLUP_KEY)
    counters = ", ".join(ROLLUP_COUNTERS)
    contribution_types = ", ".join(
        f"{column.name} {column.type.compile(dialect=postgresql.dialect())}"
        for column in (requests.c.request_id, *(daily_usage.c[name] for name in (*_ROLLUP_KEY, *ROLLUP_COUNTERS)))
    )
    return (
        f"WITH inserted AS (INSERT INTO requests ({', '.join(_RECORD_FIELDS)})"
        f" SELECT {', '.join(_RECORD_FIELDS)} FROM json_populate_recordset(NULL::requests, $1::json)"
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
    "_Contribution", [("request_id", str), *((name, Any) for name in (*_ROLLUP_KEY, *ROLLUP_COUNTERS))]
)
_json_encoder = msgspec.json.Encoder()


def _with_offset(record: RequestRecord) -> RequestRecord:
    """A naive `created_at` is UTC (`_as_utc`); sent without an offset, the server would read it in
    its own time zone."""
    if record.created_at.tzinfo is not None:
        return record
    return dataclasses.replace(record, created_at=_as_utc(record.created_at))


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
        # cached compiled statement; compiling a literal multi-row VALUES costs ~1 ms per row.
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


_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(RequestRecord)


class Spool:
    """Append-only JSONL segments under one directory, capped in total size.

    The segment being appended to is held under an exclusive flock, so that another process sharing
    the directory never replays (and deletes) a segment still being written.
    """

    def __init__(self, directory: Path, *, max_bytes: int, segment_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._current: BinaryIO | None = None  # the segment being appended to
        self._sequence = 0
        self._full_logged = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self.size_bytes = sum(path.stat().st_size for path in self.segments())

    def segments(self) -> list[Path]:
        """Segment files, oldest first (names start with a zero-padded creation time)."""
        return sorted(self.directory.glob("*.jsonl"))

    def append(self, records: Sequence[RequestRecord]) -> int:
        """Write and fsync `records`; returns how many were written (fewer when the cap is hit)."""
        lines: list[bytes] = []
        room = self.max_bytes - self.size_bytes
        for record in records:
            line = _record_encoder.encode(record) + b"\n"
            if len(line) > room:
                break
            lines.append(line)
            room -= len(line)
        if len(lines) < len(records) and not self._full_logged:
            logger.error(
                "accounting spool %s is full (%d of %d bytes); dropping accounting rows until the "
                "database is reachable again",
                self.directory,
                self.size_bytes,
                self.max_bytes,
            )
            self._full_logged = True
        if not lines:
            return 0
        data = b"".join(lines)
        if self._current is None or self._current.tell() >= self.segment_bytes:
            self._current = self._open_segment()
        self._current.write(data)
        self._current.flush()
        os.fsync(self._current.fileno())
        self.size_bytes += len(data)
        return len(lines)

    def _open_segment(self) -> BinaryIO:
        self.seal()
        self._sequence += 1
        path = self.directory / f"{time.time_ns():020d}-{os.getpid()}-{self._sequence:06d}.jsonl"
        segment = path.open("ab")
        fcntl.flock(segment.fileno(), fcntl.LOCK_EX)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new directory entry must survive a crash too
        finally:
            os.close(directory)
        return segment

    def seal(self) -> None:
        """Stop appending to the current segment so that it can be replayed."""
        if self._current is not None:
            self._current.close()
            self._current = None

    def claim(self, path: Path) -> tuple[BinaryIO, list[RequestRecord]] | None:
        """Lock a segment for replay and read it; None when another process holds it or it is gone.
        Unreadable lines (a torn final write after a crash) are logged and skipped."""
        try:
            segment = path.open("rb")
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(segment.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            segment.close()
            return None
        records: list[RequestRecord] = []
        for number, line in enumerate(segment, start=1):
            if not line.strip():
                continue
            try:
                records.append(_record_decoder.decode(line))
            except msgspec.DecodeError as exc:
                logger.warning("accounting spool %s line %d is unreadable, skipped: %s", path, number, exc)
        return segment, records

    def release(self, path: Path, segment: BinaryIO, *, done: bool) -> None:
        """Delete a replayed segment (`done`) or give it back for a later attempt."""
        if done:
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                self.size_bytes = max(0, self.size_bytes - size)
            if not self.segments():
                self._full_logged = False
        segment.close()


@dataclasses.dataclass(frozen=True, slots=True)
class AccountingStats:
    """Counters for metrics. `written` counts rows inserted (replays included), `spooled` rows sent
    to the spool, `replayed` rows read back from it, `dropped` rows lost to a full queue or spool,
    `rejected` rows the database refused as invalid, `pending` rows queued in memory now."""

    written: int
    spooled: int
    replayed: int
    dropped: int
    rejected: int
    pending: int
    spool_bytes: int
    database_up: bool


class AccountingWriter:
    """Batches `RequestRecord`s into the database from a background task; see the module docstring."""

    def __init__(
        self,
        engine: AsyncEngine,
        spool_dir: Path | str,
        *,
        batch_size: int = 500,
        flush_interval_s: float = 0.2,
        max_pending: int = 100_000,
        max_spool_bytes: int = 1 << 30,
        spool_segment_bytes: int = 8 << 20,
        retry_interval_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.retry_interval_s = retry_interval_s
        self.spool = Spool(Path(spool_dir), max_bytes=max_spool_bytes, segment_bytes=spool_segment_bytes)
        self._pending: deque[RequestRecord] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._database_up = True
        self._next_attempt = 0.0  # monotonic time of the next database attempt while it is down
        self._overflow_logged = False
        # Postgres: one connection held between flushes, so that a flush is one round trip, not a
        # pool checkout with its liveness ping (BEGIN, ping, ROLLBACK) first.
        self._connection: AsyncConnection | None = None
        self._connection_used = 0.0
        self.written = 0
        self.spooled = 0
        self.replayed = 0
        self.dropped = 0
        self.rejected = 0

    def stats(self) -> AccountingStats:
        return AccountingStats(
            written=self.written,
            spooled=self.spooled,
            replayed=self.replayed,
            dropped=self.dropped,
            rejected=self.rejected,
            pending=len(self._pending),
            spool_bytes=self.spool.size_bytes,
            database_up=self._database_up,
        )

    async def start(self) -> None:
        """Start the background writer; a spool left by an earlier process is replayed first."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="accounting-writer")

    def submit(self, record: RequestRecord) -> None:
        """Queue `record`. O(1), never blocks, never raises."""
        try:
            if self._closed:
                # Late records (a request finishing during shutdown) go straight to the spool.
                self._spool([record])
                return
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                if not self._overflow_logged:
                    logger.error("accounting queue full (%d rows); dropping rows", self.max_pending)
                    self._overflow_logged = True
                return
            self._pending.append(record)
            if len(self._pending) >= self.batch_size:
                self._wakeup.set()
        except Exception:
            logger.exception("accounting: could not queue request %s", getattr(record, "request_id", "?"))

    async def close(self) -> None:
        """Write (or spool, when the database is down) everything queued, then stop."""
        if self._closed:
            return
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        else:
            await self._flush()
        self._closed = True
        self.spool.seal()
        await self._drop_connection(broken=False)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self.flush_interval_s)
            self._wakeup.clear()
            closing = self._closing
            try:
                await self._flush()
            except Exception:
                # Never let the writer die: whatever went wrong, the next round retries. On close
                # there is no next round; what is still queued is reported lost.
                logger.exception("accounting writer round failed")
                if closing and self._pending:
                    logger.error("accounting: %d rows lost on close", len(self._pending))
                    self.dropped += len(self._pending)
                    self._pending.clear()
            if closing and not self._pending:
                return

    async def _flush(self) -> None:
        # While the database is down it is retried every retry_interval_s, and once more on close.
        if not self._database_up and not self._closing and time.monotonic() < self._next_attempt:
            await self._spool_pending()
            return
        if self.spool.segments() and not await self._replay():
            await self._spool_pending()
            return
        # Rows queued while this round writes wait for the next one (unless closing): chasing them
        # would cost a round trip for every few rows.
        due = len(self._pending)
        while self._pending and (due > 0 or self._closing):
            batch = [self._pending.popleft() for _ in range(min(self.batch_size, len(self._pending)))]
            due -= len(batch)
            if not await self._write(batch):
                await asyncio.to_thread(self._spool, batch)
                await self._spool_pending()
                return
        self._overflow_logged = False

    async def _write(self, batch: Sequence[RequestRecord]) -> bool:
        """Write one batch; False when the database is unreachable. The caller then spools the whole
        batch: rows of it already committed are skipped on replay."""
        try:
            self.written += await self._write_batch(batch)
        except (sa.exc.IntegrityError, sa.exc.DataError) as exc:
            if len(batch) == 1:
                self.rejected += 1
                logger.error("accounting: database rejected request %s: %s", batch[0].request_id, exc)
            else:
                # One bad row must not hold back the rest (nor poison the spool): write rows one by one.
                for record in batch:
                    if not await self._write([record]):
                        return False
        except Exception as exc:
            self._mark_down(exc)
            return False
        self._mark_up()
        return True

    async def _write_batch(self, batch: Sequence[RequestRecord]) -> int:
        if self.engine.dialect.name != "postgresql":
            return await write_batch(self.engine, batch)
        now = time.monotonic()
        if self._connection is not None and now - self._connection_used > HELD_CONNECTION_IDLE_S:
            await self._drop_connection(broken=False)  # long idle: the server may have dropped it
        if self._connection is None:
            self._connection = await self.engine.connect()
        self._connection_used = now
        try:
            return await write_batch(self._connection, batch)
        except (sa.exc.IntegrityError, sa.exc.DataError):
            raise  # the row was refused; the connection is fine
        except BaseException:
            await self._drop_connection(broken=True)
            raise

    async def _drop_connection(self, *, broken: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        with contextlib.suppress(Exception):
            if broken:
                await connection.invalidate()  # never back into the pool
            await connection.close()

    async def _replay(self) -> bool:
        """Replay spooled segments, oldest first; False when the database went away meanwhile."""
        self.spool.seal()
        for path in self.spool.segments():
            claimed = await asyncio.to_thread(self.spool.claim, path)
            if claimed is None:
                continue
            segment, records = claimed
            done = False
            try:
                for start in range(0, len(records), self.batch_size):
                    if not await self._write(records[start : start + self.batch_size]):
                        return False
                self.replayed += len(records)
                done = True
            finally:
                self.spool.release(path, segment, done=done)
            logger.info("accounting: replayed %d spooled rows from %s", len(records), path.name)
        return True

    async def _spool_pending(self) -> None:
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(self.batch_size, len(self._pending)))]
            await asyncio.to_thread(self._spool, batch)

    def _spool(self, batch: Sequence[RequestRecord]) -> None:
        written = self.spool.append(batch)
        self.spooled += written
        self.dropped += len(batch) - written

    def _mark_down(self, exc: BaseException) -> None:
        if self._database_up:
            logger.warning("accounting: database unreachable (%s); spooling to %s", exc, self.spool.directory)
        self._database_up = False
        self._next_attempt = time.monotonic() + self.retry_interval_s

    def _mark_up(self) -> None:
        if not self._database_up:
            logger.info("accounting: database reachable again")
        self._database_up = True
