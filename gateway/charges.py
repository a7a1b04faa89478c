"""The charge batcher: what admitted requests spent, written to the shared counters off the
request path, many subjects per round trip.

A settlement the counters refuse (Redis down or silent) is never only logged: it goes to a spool on
disk (`gateway.accounting.spool`, the accounting spool's format, in its own directory) and is applied
when Redis answers again, by this process or, after a restart, by the next one. In `local` mode a
request admitted in this replica's counters while Redis was down (`Admission.local`) is settled there.

A settlement is sent at least once and applied once: the charges a round trip carries become one
`Settlement` per minute, with a fresh id, kept (in memory or in the spool) under that id until Redis
answers, and the counters apply an id only once (`gateway.counters`). So one whose
reply was lost (a timeout, a connection cut mid-write) and was applied is not applied again when sent
again, nor is a spooled one replayed twice (a crash between applying a segment and deleting it), for
`SETTLEMENT_ID_TTL_S` after it was first applied. Once applied and kept here no more (answered, its
segment deleted), its id goes with the next round trip for the counters to keep only
`SETTLEMENT_ID_GRACE_S` more, so that Redis holds about an hour of ids, not two days.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from gateway.accounting.spool import Spool
from gateway.counters import Charge, CounterStore, CountersUnavailable, Settlement

log = logging.getLogger("sluice.gateway")

# Charges wait this long for others to share their Redis round trip: a budget sees spend this much
# later, and a round trip per request (a loopback send costs more CPU than the rest of a charge) is
# spared at any load.
CHARGE_COALESCE_S = 0.02
CHARGE_RETRY_S = 1.0  # a settlement the counters refused is kept and tried again this often
DRAIN_TIMEOUT_S = 5.0  # shutdown waits this long for settlements before leaving them to the spool
SPOOL_MAX_BYTES = 64 << 20  # ~500k settlements: hours of a busy gateway's outage
SPOOL_SEGMENT_BYTES = 1 << 20

Pending = dict[tuple[str, float], Charge]  # (subject, minute start) → charge, not sent yet
Batch = list[tuple[float, Settlement]]  # (minute start, settlement): sent under its id until applied


class SpooledCharge(msgspec.Struct, frozen=True):
    """One settlement on disk: a subject's charge to the windows of `at` (a minute start)."""

    subject: str
    at: float
    completion_tokens: int
    cost_usd: float
    settlement: str = ""  # the id of the settlement it is part of ("": spooled by a version without ids)


class ChargeBatcher:
    """Queue charges (settlements of reservations, usually negative) to the windows of the time
    they were reserved at; one task writes them. Charges arriving within CHARGE_COALESCE_S, or while
    it waits on a round trip, go together in the next one. Those the counters refuse are spooled to
    `spool_dir` (kept in memory without one) and tried again every CHARGE_RETRY_S until applied."""

    def __init__(
        self, counters: CounterStore, clock: Callable[[], float] = time.time, spool_dir: Path | None = None
    ) -> None:
        self.counters = counters
        self.clock = clock
        self.spool: Spool[SpooledCharge] | None = None
        if spool_dir is not None:
            self.spool = Spool(spool_dir, max_bytes=SPOOL_MAX_BYTES, segment_bytes=SPOOL_SEGMENT_BYTES,
                               item_type=SpooledCharge, what="spend settlements")  # fmt: skip
        self._pending: Pending = {}
        self._pending_local: Pending = {}  # settlements of requests admitted in this replica's counters
        self._in_flight: Batch = []  # its round trip not yet answered
        self._kept: Batch = []  # refused, to send again (without a spool)
        self._forgotten: list[str] = []  # ids of settlements applied and kept no more, for the counters to forget
        self._spool_waiting = False  # spooled settlements this process has yet to replay
        self._writing: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Apply settlements an earlier process spooled (call once the event loop runs)."""
        if self.spool is not None and self.spool.segments():
            self._spool_waiting = True
            self._wake()

    def charge(self, subject: str, charge: Charge, at: float | None = None, local: bool = False) -> None:
        """Queue `charge` to `subject`'s windows of the time `at`; `local`: the request was admitted
        in this replica's counters (`Admission.local`), and is settled there."""
        minute = float(int((self.clock() if at is None else at) // 60) * 60)
        _add(self._pending_local if local else self._pending, (subject, minute), charge)
        self._wake()

    @property
    def unsettled(self) -> Pending:
        """Charges queued, in flight, or kept (in memory or spooled) through an outage, not yet applied."""
        kept: Pending = {}
        for source in (self._pending, self._pending_local):
            for key, charge in source.items():
                _add(kept, key, charge)
        for at, settlement in (*self._in_flight, *self._kept, *self._spooled()):
            for subject, charge in settlement.charges.items():
                _add(kept, (subject, at), charge)
        return kept

    def _spooled(self) -> Batch:
        if self.spool is None:
            return []
        batch: Batch = []
        decoder = msgspec.json.Decoder(SpooledCharge)
        for path in self.spool.segments():
            entries = [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
            batch += _from_spool(entries, path.name)
        return batch

    def _wake(self) -> None:
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        await asyncio.sleep(CHARGE_COALESCE_S)
        try:
            while self._pending or self._pending_local or self._kept or self._spool_waiting:
                if self._pending_local:
                    local, self._pending_local = self._pending_local, {}
                    for at, settlement in await self._apply(_settlements(local), local=True):  # never refused
                        for subject, charge in settlement.charges.items():  # nothing applied: sent anew
                            _add(self._pending_local, (subject, at), charge)
                self._in_flight, self._kept = self._kept + _settlements(self._pending), []
                self._pending = {}
                failed = await self._apply(self._in_flight)
                if failed:
                    await self._keep(failed)
                self._forget(self._in_flight, failed)
                self._in_flight = []  # only once kept: `unsettled` counts them meanwhile
                if not failed and self._spool_waiting and await self._replay():
                    self._spool_waiting = False
                    continue
                if failed or self._spool_waiting:
                    await asyncio.sleep(CHARGE_RETRY_S)
        except asyncio.CancelledError:
            self._kept, self._in_flight = self._in_flight + self._kept, []  # maybe applied: resent, applied once
            raise

    async def _apply(self, batch: Batch, local: bool = False) -> Batch:
        """Apply `batch`, one round trip per window; the settlements of those the counters refused."""
        by_window: dict[float, list[Settlement]] = {}
        for at, settlement in batch:
            by_window.setdefault(at, []).append(settlement)
        failed: Batch = []
        forget: list[str] = []
        if not local:  # ids Redis is to forget; this replica's counters bound theirs by number
            forget, self._forgotten = self._forgotten, []
        for at, settlements in by_window.items():
            try:
                await self.counters.charge_many(settlements, at, local, forget)
                forget = []
            except CountersUnavailable as exc:
                log.warning("%d spend settlements kept until the counters answer: %s", len(settlements), exc)
                failed += [(at, settlement) for settlement in settlements]
        self._forgotten += forget  # not sent: with the next round trip
        return failed

    def _forget(self, sent: Batch, failed: Batch) -> None:
        """Those of `sent` not `failed` are kept no more: their ids go to the counters' next round trip."""
        kept = {settlement.id for _, settlement in failed}
        self._forgotten += [settlement.id for _, settlement in sent if settlement.id not in kept]

    async def _keep(self, failed: Batch) -> None:
        """Spool `failed` (in memory without a spool) for a later attempt, under the same ids."""
        if self.spool is None:
            self._kept += failed
            return
        await asyncio.to_thread(self._spool_now, failed)

    def _spool_now(self, batch: Batch) -> None:
        assert self.spool is not None
        entries = [SpooledCharge(subject, at, charge.completion_tokens, charge.cost_usd, settlement.id)
                   for at, settlement in batch for subject, charge in settlement.charges.items()]  # fmt: skip
        written = self.spool.append(entries)
        for entry in entries[written:]:
            log.error("spend settlement lost (spool full): %s", entry)
        self._spool_waiting = self._spool_waiting or written > 0

    async def _replay(self) -> bool:
        """Apply spooled settlements, oldest segment first; False when the counters refused again.
        A segment another process holds is its to replay."""
        assert self.spool is not None
        self.spool.seal()
        for path in self.spool.segments():
            claimed = await asyncio.to_thread(self.spool.claim, path)
            if claimed is None:
                continue
            segment, entries = claimed
            batch = _from_spool(entries, path.name)
            done = False
            try:
                failed = await self._apply(batch)
                if failed and len(failed) < len(batch):
                    await asyncio.to_thread(self._spool_now, failed)  # the rest was applied: keep only these
                done = len(failed) < len(batch) or not batch
            finally:
                self.spool.release(path, segment, done=done)
            if done:  # deleted (the failed ones spooled again): the applied ones are kept no more
                self._forget(batch, failed)
            if failed:
                return False
            log.info("applied %d spooled spend settlements from %s", len(entries), path.name)
        return True

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until queued charges are written (shutdown; tests that read counters). Charges still
        unapplied after `timeout_s` (the counters stayed down) go to the spool, for the next process;
        without a spool they are logged with their amounts."""
        task = self._writing
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._pending:
            self._kept += _settlements(self._pending)
            self._pending = {}
        if self._kept and self.spool is not None:
            unsent, self._kept = self._kept, []
            await asyncio.to_thread(self._spool_now, unsent)
        if self.spool is not None:
            self.spool.seal()
        for at, settlement in self._kept:
            log.error("unapplied spend at shutdown: at %.0f: %s", at, settlement)


def _settlements(pending: Pending) -> Batch:
    """`pending` as settlements to send: one per minute, each under a fresh id."""
    by_window: dict[float, dict[str, Charge]] = {}
    for (subject, at), charge in pending.items():
        by_window.setdefault(at, {})[subject] = charge
    return [(at, Settlement(uuid.uuid4().hex, charges)) for at, charges in by_window.items()]


def _from_spool(entries: list[SpooledCharge], segment: str) -> Batch:
    """Spooled entries as the settlements they were part of; those spooled without an id are taken as
    one settlement per minute of their segment, so that replaying it twice applies them once too."""
    by_id: dict[tuple[float, str], dict[str, Charge]] = {}
    for entry in entries:
        charges = by_id.setdefault((entry.at, entry.settlement or f"{segment}:{entry.at:.0f}"), {})
        charge = Charge(entry.completion_tokens, entry.cost_usd)
        # An entry of a settlement twice is one copy spooled twice (a shutdown cut a spool write short).
        charges[entry.subject] = charge if entry.settlement else charges.get(entry.subject, Charge()) + charge
    return [(at, Settlement(settlement_id, charges)) for (at, settlement_id), charges in by_id.items()]


def _add(charges: Pending, key: tuple[str, float], charge: Charge) -> None:
    kept = charges.get(key)
    charges[key] = charge if kept is None else kept + charge
