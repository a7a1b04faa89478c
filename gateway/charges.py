"""The charge batcher: what admitted requests spent, written to the shared counters off the
request path, many subjects per round trip."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.counters import Charge, CounterStore, CountersUnavailable

log = logging.getLogger("sluice.gateway")

# Charges wait this long for others to share their Redis round trip: a budget sees spend this much
# later, and a round trip per request (a loopback send costs more CPU than the rest of a charge) is
# spared at any load.
CHARGE_COALESCE_S = 0.02
CHARGE_RETRY_S = 1.0  # a settlement the counters refused is kept and tried again this often
DRAIN_TIMEOUT_S = 5.0  # shutdown waits this long for settlements before reporting them unapplied


class ChargeBatcher:
    """Queue charges (settlements of reservations, usually negative) to the windows of the time
    they were reserved at; one task writes them. Charges arriving within CHARGE_COALESCE_S, or while
    it waits on a round trip, go together in the next one. Those the counters refuse (Redis down) are
    kept and tried again every CHARGE_RETRY_S until applied: a charge is never only logged."""

    def __init__(self, counters: CounterStore, clock: Callable[[], float] = time.time) -> None:
        self.counters = counters
        self.clock = clock
        self._pending: dict[tuple[str, float], Charge] = {}  # (subject, minute start) → charge
        self._writing: asyncio.Task[None] | None = None

    def charge(self, subject: str, charge: Charge, at: float | None = None) -> None:
        minute = float(int((self.clock() if at is None else at) // 60) * 60)
        self._add((subject, minute), charge)
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write())

    @property
    def unsettled(self) -> dict[tuple[str, float], Charge]:
        """Charges queued, or kept through a counters outage, not yet applied."""
        return dict(self._pending)

    def _add(self, key: tuple[str, float], charge: Charge) -> None:
        pending = self._pending.get(key)
        self._pending[key] = charge if pending is None else pending + charge

    async def _write(self) -> None:
        await asyncio.sleep(CHARGE_COALESCE_S)
        while self._pending:
            charges, self._pending = self._pending, {}
            by_window: dict[float, dict[str, Charge]] = {}
            for (subject, at), charge in charges.items():
                by_window.setdefault(at, {})[subject] = charge
            failed = False
            for at, group in by_window.items():
                try:
                    await self.counters.charge_many(group, at)
                except CountersUnavailable as exc:
                    log.warning("spend of %d subjects kept until the counters answer: %s", len(group), exc)
                    failed = True
                    for subject, charge in group.items():
                        self._add((subject, at), charge)
            if failed:
                await asyncio.sleep(CHARGE_RETRY_S)

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until queued charges are written (shutdown; tests that read counters). Charges still
        unapplied after `timeout_s` (the counters stayed down) are logged with their amounts."""
        task = self._writing
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            task.cancel()
            for (subject, at), charge in self._pending.items():
                log.error("unapplied spend at shutdown: %s at %.0f: %s", subject, at, charge)
