"""The writer loop: `AccountingWriter.submit` queues a record in memory; a background task writes
batches through the SQL writer, or to the spool while the database is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.accounting.record import RequestRecord
from gateway.accounting.spool import Spool
from gateway.accounting.sql import write_batch

logger = logging.getLogger("gateway.accounting")

HELD_CONNECTION_IDLE_S = 60.0  # the writer's Postgres connection is replaced after this long unused

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
