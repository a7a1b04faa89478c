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


class ChargeBatcher:
    """Queue charges; one task writes them. Charges arriving within CHARGE_COALESCE_S, or while it
    waits on a round trip, go together in the next one."""

    def __init__(self, counters: CounterStore, clock: Callable[[], float] = time.time) -> None:
        self.counters = counters
        self.clock = clock
        self._pending: dict[str, Charge] = {}
        self._writing: asyncio.Task[None] | None = None

    def charge(self, subject: str, charge: Charge) -> None:
        pending = self._pending.get(subject)
        self._pending[subject] = charge if pending is None else pending + charge
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        await asyncio.sleep(CHARGE_COALESCE_S)
        while self._pending:
            charges, self._pending = self._pending, {}
            try:
                await self.counters.charge_many(charges, self.clock())
            except CountersUnavailable:
                log.exception("spend of %d subjects could not be charged", len(charges))

    async def drain(self) -> None:
        """Wait until queued charges are written (shutdown; tests that read counters)."""
        while self._writing is not None and not self._writing.done():
            await self._writing
