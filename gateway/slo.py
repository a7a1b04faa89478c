"""SLO-aware admission: each tier's recent time to first token and inter-token latency against its
`slo_ttft_p99_ms` and `slo_itl_p99_ms`.

Pressure is the worse of (p99 TTFT / its SLO) and (p99 ITL / its SLO) over the last `window_s` seconds of
successful interactive requests (streams: non-streamed answers have no TTFT or ITL to judge). At
`BATCH_SHED_AT` of an SLO, batch work stops taking new lines (it is shed first); over the SLO, new
interactive requests for that tier are answered 429 with Retry-After rather than queued to miss it too.
Old samples age out of the window, so a tier recovers by itself once its queue drains.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from gateway.config import TierConfig

WINDOW_S = 30.0
MIN_SAMPLES = 20  # fewer recent samples than this: no verdict (pressure 0)
BATCH_SHED_AT = 0.8  # pressure at which batch work stops taking new lines
RECOMPUTE_S = 0.25  # pressure is recomputed at most this often per tier (a sort of the window)


def _p99(values: list[float]) -> float:
    values.sort()
    return values[min(len(values) - 1, int(0.99 * len(values)))]


class _TierWindow:
    def __init__(self, tier: TierConfig) -> None:
        self.slo_ttft_ms = tier.slo_ttft_p99_ms
        self.slo_itl_ms = tier.slo_itl_p99_ms
        self.samples: deque[tuple[float, float | None, float | None]] = deque()  # (when, ttft_ms, itl_ms)
        self.pressure = 0.0
        self.computed_at = float("-inf")

    def within(self, ttft_ms: float | None, itl_ms: float | None) -> bool:
        return (ttft_ms is None or ttft_ms <= self.slo_ttft_ms) and (itl_ms is None or itl_ms <= self.slo_itl_ms)

    def recompute(self, now: float, window_s: float, min_samples: int) -> float:
        while self.samples and self.samples[0][0] < now - window_s:
            self.samples.popleft()
        ttfts = [s[1] for s in self.samples if s[1] is not None]
        itls = [s[2] for s in self.samples if s[2] is not None]
        ratios = [_p99(ttfts) / self.slo_ttft_ms if len(ttfts) >= min_samples else 0.0,
                  _p99(itls) / self.slo_itl_ms if len(itls) >= min_samples else 0.0]  # fmt: skip
        self.pressure, self.computed_at = max(ratios), now
        return self.pressure


class SloTracker:
    def __init__(self, tiers: Mapping[str, TierConfig], clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S, min_samples: int = MIN_SAMPLES) -> None:  # fmt: skip
        self.windows = {name: _TierWindow(tier) for name, tier in tiers.items()}
        self.clock = clock
        self.window_s = window_s
        self.min_samples = min_samples

    def observe(self, tier: str, ttft_ms: float | None, itl_ms: float | None) -> bool:
        """Count a successful interactive request; whether it met the tier's SLOs (goodput)."""
        window = self.windows.get(tier)
        if window is None:
            return False
        if ttft_ms is not None or itl_ms is not None:
            window.samples.append((self.clock(), ttft_ms, itl_ms))
        return window.within(ttft_ms, itl_ms)

    def pressure(self, tier: str) -> float:
        """The tier's worse p99 over its SLO (1.0: at the SLO); 0 without enough recent samples."""
        window = self.windows.get(tier)
        if window is None:
            return 0.0
        now = self.clock()
        if now - window.computed_at < RECOMPUTE_S:
            return window.pressure
        return window.recompute(now, self.window_s, self.min_samples)

    def overloaded(self, tier: str) -> bool:
        return self.pressure(tier) > 1.0

    def batch_may_run(self) -> bool:
        """Batch work is shed first: no new batch line while any tier's interactive SLO is at risk."""
        return all(self.pressure(tier) < BATCH_SHED_AT for tier in self.windows)
