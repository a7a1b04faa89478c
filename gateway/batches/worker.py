"""The batch worker: a task in the gateway process that takes unfinished batches one at a time, runs their
lines a few at a time through the request path, and writes the output and error files when none is left.

Every step is committed before the next (`gateway.batches.store`), so a gateway stopped at any point resumes
where it was: shut down cleanly, it hands its batch back at once; killed, its lease runs out and the next
worker puts the lines it had claimed (and not recorded) back to pending. A recorded line never runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.batches import store
from gateway.batches.execute import LineRunner
from gateway.batches.files import FileStore
from gateway.batches.wire import new_id
from gateway.config import BatchConfig

log = logging.getLogger("sluice.batches")

POLL_S = 2.0  # how often an idle worker looks for batches (creating one here wakes it at once)
MAX_BEAT_S = 1.0  # a held batch's lease is renewed (and its cancellation noticed) at least this often
_RESULT_ERRORS = {
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
}


def _now() -> datetime:
    return datetime.now(UTC)


class BatchWorker:
    def __init__(self, db: AsyncEngine, files: FileStore, prepare: Callable[[Any], Awaitable[LineRunner]],
                 config: BatchConfig, may_claim: Callable[[], bool] = lambda: True) -> None:  # fmt: skip
        self.db = db
        self.files = files
        self.prepare = prepare
        self.config = config
        self.may_claim = may_claim  # False: interactive work needs the capacity (SLOs at risk); claim nothing
        self.worker_id = new_id("worker-")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._beat_s = min(config.lease_s / 3, MAX_BEAT_S)
        self._paused_until = 0.0  # loop time: no line is claimed before (a line was refused for a while)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="sluice-batch-worker")

    def wake(self) -> None:
        """Look at the batches now: one was created or cancelled (a cancel made at another replica is
        noticed at the next heartbeat)."""
        self._wake.set()

    async def close(self) -> None:
        """Stop: lines in flight are cancelled and the batch handed back (they run again, elsewhere or later)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        failing = False
        while True:
            self._wake.clear()
            try:
                batch = await store.take_batch(self.db, self.worker_id, _now(), self.config.lease_s)
                if batch is not None:
                    await self._run(batch)
                    continue
                failing = False
            except SQLAlchemyError as exc:
                if not failing:  # once per outage, not once per poll
                    log.warning("batch worker: the database failed (%s); retrying", exc)
                failing = True
            except Exception:
                log.exception("batch worker: a batch failed to run; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def _run(self, batch: Any) -> None:
        run = await self.prepare(batch)
        running: set[asyncio.Task[bool]] = set()
        try:
            status = await self._work(batch, run, running)
        except BaseException:
            await _cancel(running)
            await asyncio.shield(store.release(self.db, batch.id, self.worker_id))
            raise
        if status is None:
            await _cancel(running)  # another worker holds the batch now: these lines' answers would be void
        else:
            await self._finish(batch.id)

    async def _work(self, batch: Any, run: LineRunner, running: set[asyncio.Task[bool]]) -> str | None:
        """Claim and run lines until none is left (or the batch is cancelled or expired); the batch's status
        then, or None when another worker took the batch over."""
        loop = asyncio.get_running_loop()
        claiming, next_beat, status = True, 0.0, batch.status
        while True:
            if loop.time() >= next_beat or self._wake.is_set():  # woken: a batch was cancelled here
                self._wake.clear()
                status = await store.renew(self.db, batch.id, self.worker_id, _now(), self.config.lease_s)
                if status is None:
                    return None  # the lease ran out and another worker holds the batch: its claims are void
                next_beat = loop.time() + self._beat_s
                claiming = claiming and status == "in_progress" and _now() < store.utc(batch.expires_at)
            while claiming and len(running) < self.config.concurrency and self._may_claim(loop.time()):
                line = await store.claim_line(self.db, batch.id, self.worker_id)
                if line is None:
                    claiming = False
                    break
                running.add(asyncio.create_task(self._line(batch.id, run, line)))
            if not running and not claiming:
                return status
            if not running:  # lines are left but none may be claimed now
                await asyncio.sleep(self._beat_s)
                continue
            done, _ = await asyncio.wait(running, timeout=self._beat_s, return_when=asyncio.FIRST_COMPLETED)
            running.difference_update(done)
            # A failure to record is the database's: raised here. A line put back to pending is claimed again.
            if any([task.result() for task in done]):
                claiming = status == "in_progress"

    def _may_claim(self, now: float) -> bool:
        return now >= self._paused_until and self.may_claim()

    async def _line(self, batch_id: str, run: LineRunner, line: store.ClaimedLine) -> bool:
        """Run a line and record its answer; True when it was put back to pending instead."""
        result = await run(line)
        if result.retry_after_s is not None:
            # Refused for now (rate limits): batch work waits, it does not fail for being early.
            self._paused_until = max(self._paused_until, asyncio.get_running_loop().time() + result.retry_after_s)
            await store.unclaim_line(self.db, batch_id, line.line, self.worker_id)
            return True
        response = result.body.decode()
        if not await store.record_line(self.db, batch_id, line.line, self.worker_id, result.request_id,
                                       result.status_code, response):  # fmt: skip
            log.warning("batch %s line %d: answered after its claim was lost; not recorded", batch_id, line.line)
        return False

    async def _finish(self, batch_id: str) -> None:
        """Close the lines never run, write the output and error files, and end the batch."""
        batch = await store.find_batch(self.db, batch_id)
        assert batch is not None
        now = _now()
        final = "cancelled" if batch.cancelling_at is not None else (
            "expired" if now >= store.utc(batch.expires_at) else "completed")  # fmt: skip
        if final != "completed":
            await store.close_pending(self.db, batch_id, final)
        await store.update_held(self.db, batch_id, self.worker_id, status="finalizing", finalizing_at=now)
        output_id, error_id = await self._write_results(batch)
        await store.update_held(self.db, batch_id, self.worker_id, status=final, output_file_id=output_id,
                                error_file_id=error_id, worker=None, lease_until=None,
                                **{f"{final}_at": _now()})  # fmt: skip

    async def _write_results(self, batch: Any) -> tuple[str | None, str | None]:
        output, errors = [], []
        async for row in store.finished_lines(self.db, batch.id):
            (output if row.state == "done" else errors).append(_result_line(batch.id, row))
        ids = []
        for lines, name in ((output, "output"), (errors, "error")):
            if not lines:
                ids.append(None)
                continue
            file_id = new_id("file-")
            size = await self.files.write(file_id, lines)
            await store.insert_file(self.db, {"id": file_id, "created_at": _now(), "tenant": batch.tenant,
                                              "filename": f"{batch.id}_{name}.jsonl", "purpose": "batch_output",
                                              "bytes": size})  # fmt: skip
            ids.append(file_id)
        return ids[0], ids[1]


async def _cancel(tasks: set[asyncio.Task[bool]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _result_line(batch_id: str, row: Any) -> bytes:
    """One line of an output or error file, as OpenAI's Batch API writes it."""
    item: dict[str, Any] = {"id": f"batch_req_{batch_id.removeprefix('batch_')}_{row.line}", "custom_id": row.custom_id}
    if row.state in ("done", "failed"):
        body = msgspec.Raw(row.response.encode())
        item["response"] = {"status_code": row.status_code, "request_id": row.request_id, "body": body}
        item["error"] = None
    else:
        code, message = _RESULT_ERRORS[row.state]
        item["response"], item["error"] = None, {"code": code, "message": message}
    return msgspec.json.encode(item) + b"\n"
