"""The Batch API's rows: files, batches and their lines, each state change its own committed statement.

Exactly-once: a worker holds a batch by a lease (`batches.worker`, `lease_until`, renewed by heartbeats)
and claims each line (pending → running) with a conditional update; an answer is recorded only by the
worker holding that claim (running → done | failed), and a recorded line is never claimed again. A batch
taken over from a worker that died has its running lines (claimed, nothing recorded) put back to pending.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.batches.wire import InputLine
from gateway.db.schema import batch_lines, batches, files

UNFINISHED = ("validating", "in_progress", "cancelling", "finalizing")
RESULT_PAGE = 1000


def utc(moment: datetime | None) -> datetime | None:
    """SQLite hands datetimes back without their offset; they were stored in UTC."""
    if moment is None:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


@dataclass(frozen=True, slots=True)
class ClaimedLine:
    line: int
    custom_id: str
    body: str
    attempt: int


@dataclass(frozen=True, slots=True)
class LineCounts:
    total: int
    done: int
    failed: int


async def insert_file(db: AsyncEngine, row: dict[str, Any]) -> None:
    async with db.begin() as connection:
        await connection.execute(files.insert().values(**row))


async def find_file(db: AsyncEngine, file_id: str, tenant: str) -> sa.Row[Any] | None:
    query = sa.select(files).where(files.c.id == file_id, files.c.tenant == tenant)
    async with db.connect() as connection:
        return (await connection.execute(query)).first()


async def list_files(db: AsyncEngine, tenant: str, purpose: str | None, after: str | None, limit: int,
                     newest_first: bool) -> list[sa.Row[Any]]:
    """A tenant's files (of one purpose, or all) in id order (ids are time-ordered), after the id `after`;
    `limit` + 1 read."""
    order = files.c.id.desc() if newest_first else files.c.id.asc()
    query = sa.select(files).where(files.c.tenant == tenant).order_by(order).limit(limit + 1)
    if purpose:
        query = query.where(files.c.purpose == purpose)
    if after:
        query = query.where(files.c.id < after if newest_first else files.c.id > after)
    async with db.connect() as connection:
        return list((await connection.execute(query)).all())


async def delete_file(db: AsyncEngine, file_id: str, tenant: str) -> bool:
    """Delete a tenant's file row; whether it existed."""
    async with db.begin() as connection:
        result = await connection.execute(files.delete().where(files.c.id == file_id, files.c.tenant == tenant))
    return result.rowcount == 1


async def insert_batch(db: AsyncEngine, row: dict[str, Any], lines: list[InputLine]) -> None:
    """The batch and all its lines (pending) in one transaction: a batch exists whole or not at all."""
    async with db.begin() as connection:
        await connection.execute(batches.insert().values(**row))
        if lines:
            await connection.execute(
                batch_lines.insert(),
                [{"batch_id": row["id"], "line": x.line, "custom_id": x.custom_id, "body": x.body,
                  "state": "pending", "attempts": 0} for x in lines],
            )


async def find_batch(db: AsyncEngine, batch_id: str, tenant: str | None = None) -> sa.Row[Any] | None:
    query = sa.select(batches).where(batches.c.id == batch_id)
    if tenant is not None:
        query = query.where(batches.c.tenant == tenant)
    async with db.connect() as connection:
        return (await connection.execute(query)).first()


async def list_batches(db: AsyncEngine, tenant: str, after: str | None, limit: int) -> list[sa.Row[Any]]:
    """A tenant's batches, newest first (ids are time-ordered), after the id `after`; `limit` + 1 read."""
    query = sa.select(batches).where(batches.c.tenant == tenant).order_by(batches.c.id.desc()).limit(limit + 1)
    if after:
        query = query.where(batches.c.id < after)
    async with db.connect() as connection:
        return list((await connection.execute(query)).all())


async def line_counts(db: AsyncEngine, batch_ids: list[str]) -> dict[str, LineCounts]:
    query = (
        sa.select(batch_lines.c.batch_id, batch_lines.c.state, sa.func.count())
        .where(batch_lines.c.batch_id.in_(batch_ids))
        .group_by(batch_lines.c.batch_id, batch_lines.c.state)
    )
    by_batch: dict[str, dict[str, int]] = {batch_id: {} for batch_id in batch_ids}
    async with db.connect() as connection:
        for batch_id, state, count in await connection.execute(query):
            by_batch[batch_id][state] = count
    return {b: LineCounts(sum(c.values()), c.get("done", 0), c.get("failed", 0)) for b, c in by_batch.items()}


async def request_cancel(db: AsyncEngine, batch_id: str, tenant: str, now: datetime) -> None:
    """validating | in_progress → cancelling; the worker stops claiming lines and finishes the batch."""
    async with db.begin() as connection:
        await connection.execute(
            batches.update()
            .where(batches.c.id == batch_id, batches.c.tenant == tenant,
                   batches.c.status.in_(("validating", "in_progress")))
            .values(status="cancelling", cancelling_at=now)
        )


async def take_batch(db: AsyncEngine, worker: str, now: datetime, lease_s: float) -> sa.Row[Any] | None:
    """An unfinished batch nobody holds (or whose holder's lease ran out), now held by `worker`."""
    free = sa.or_(batches.c.worker.is_(None), batches.c.lease_until < now)
    query = sa.select(batches.c.id).where(batches.c.status.in_(UNFINISHED), free).order_by(batches.c.id).limit(8)
    async with db.connect() as connection:
        candidates = list((await connection.execute(query)).scalars())
    for batch_id in candidates:
        async with db.begin() as connection:
            taken = await connection.execute(
                batches.update().where(batches.c.id == batch_id, batches.c.status.in_(UNFINISHED), free)
                .values(worker=worker, lease_until=now + timedelta(seconds=lease_s))
            )
            if taken.rowcount != 1:
                continue  # another worker took it first
            # Claimed by a previous holder, never recorded: those calls died with it.
            await connection.execute(
                batch_lines.update().where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "running")
                .values(state="pending", worker=None)
            )
            await connection.execute(
                batches.update().where(batches.c.id == batch_id, batches.c.status == "validating")
                .values(status="in_progress", in_progress_at=now)
            )
            return (await connection.execute(sa.select(batches).where(batches.c.id == batch_id))).first()
    return None


async def renew(db: AsyncEngine, batch_id: str, worker: str, now: datetime, lease_s: float) -> str | None:
    """Extend the lease; the batch's status, or None when `worker` no longer holds it."""
    async with db.begin() as connection:
        renewed = await connection.execute(
            batches.update().where(batches.c.id == batch_id, batches.c.worker == worker)
            .values(lease_until=now + timedelta(seconds=lease_s))
        )
        if renewed.rowcount != 1:
            return None
        return (await connection.execute(sa.select(batches.c.status).where(batches.c.id == batch_id))).scalar()


async def release(db: AsyncEngine, batch_id: str, worker: str) -> None:
    """Hand a batch back (shutdown): its running lines to pending, the batch to whoever takes it next."""
    async with db.begin() as connection:
        held = await connection.execute(
            batches.update().where(batches.c.id == batch_id, batches.c.worker == worker)
            .values(worker=None, lease_until=None)
        )
        if held.rowcount == 1:
            await connection.execute(
                batch_lines.update()
                .where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "running",
                       batch_lines.c.worker == worker)
                .values(state="pending", worker=None)
            )


async def claim_line(db: AsyncEngine, batch_id: str, worker: str) -> ClaimedLine | None:
    """The first pending line, now running for `worker`; None when no line is pending."""
    pending = (
        sa.select(batch_lines.c.line, batch_lines.c.custom_id, batch_lines.c.body, batch_lines.c.attempts)
        .where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "pending")
        .order_by(batch_lines.c.line)
        .limit(1)
    )
    while True:
        async with db.begin() as connection:
            row = (await connection.execute(pending)).first()
            if row is None:
                return None
            claimed = await connection.execute(
                batch_lines.update()
                .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line == row.line,
                       batch_lines.c.state == "pending")
                .values(state="running", worker=worker, attempts=batch_lines.c.attempts + 1)
            )
            if claimed.rowcount == 1:
                return ClaimedLine(row.line, row.custom_id, row.body, row.attempts + 1)


async def record_line(
    db: AsyncEngine, batch_id: str, line: int, worker: str, request_id: str, status_code: int, response: str
) -> bool:
    """Record a line's answer, only under `worker`'s claim: False when the claim was lost (not recorded)."""
    state = "done" if 200 <= status_code < 300 else "failed"
    async with db.begin() as connection:
        recorded = await connection.execute(
            batch_lines.update()
            .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line == line,
                   batch_lines.c.state == "running", batch_lines.c.worker == worker)
            .values(state=state, request_id=request_id, status_code=status_code, response=response)
        )
    return recorded.rowcount == 1


async def unclaim_line(db: AsyncEngine, batch_id: str, line: int, worker: str) -> None:
    """Put a line `worker` claimed back to pending, unanswered (it was refused for a while: rate limits)."""
    async with db.begin() as connection:
        await connection.execute(
            batch_lines.update()
            .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line == line,
                   batch_lines.c.state == "running", batch_lines.c.worker == worker)
            .values(state="pending", worker=None)
        )


async def close_pending(db: AsyncEngine, batch_id: str, state: str) -> None:
    """Lines never run (the batch was cancelled or expired) end as `state`."""
    async with db.begin() as connection:
        await connection.execute(
            batch_lines.update().where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "pending")
            .values(state=state)
        )


async def update_held(db: AsyncEngine, batch_id: str, holder: str, **values: Any) -> bool:
    """Change a batch `holder` holds; False when it no longer does."""
    async with db.begin() as connection:
        updated = await connection.execute(
            batches.update().where(batches.c.id == batch_id, batches.c.worker == holder).values(**values)
        )
    return updated.rowcount == 1


async def finished_lines(db: AsyncEngine, batch_id: str) -> AsyncIterator[sa.Row[Any]]:
    """Every line of a batch in input order, a page at a time (output files can be large)."""
    after = -1
    while True:
        query = (
            sa.select(batch_lines.c.line, batch_lines.c.custom_id, batch_lines.c.state, batch_lines.c.request_id,
                      batch_lines.c.status_code, batch_lines.c.response)
            .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line > after)
            .order_by(batch_lines.c.line)
            .limit(RESULT_PAGE)
        )
        async with db.connect() as connection:
            rows = (await connection.execute(query)).all()
        for row in rows:
            yield row
        if len(rows) < RESULT_PAGE:
            return
        after = rows[-1].line
