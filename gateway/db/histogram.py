"""Latency histograms of the hourly rollup: fixed log-spaced buckets, counted in plain integer columns.

Percentiles over any time range are then sums of a few thousand rollup rows, not a sort of millions
of request rows (and the same SQL works on Postgres and SQLite). Bucket 0 holds [0, 1 ms); bucket i
(1 ≤ i < BUCKETS - 1) holds [2^((i-1)/3), 2^(i/3)) ms; the last bucket is open above ~65 s. Three
buckets per octave: a percentile read back is within one bucket (a factor 2^(1/3) ≈ 1.26) of the
exact one, and interpolation inside the bucket usually brings it much closer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

BUCKETS = 50
PER_OCTAVE = 3
METRICS = ("ttft", "itl")  # time to first token; inter-token latency (each request's mean)

# Upper edges in ms of buckets 0 .. BUCKETS-2; the last bucket has none.
EDGES_MS: tuple[float, ...] = tuple(2 ** (i / PER_OCTAVE) for i in range(BUCKETS - 1))


def bucket_of(value_ms: float) -> int:
    """The bucket that counts `value_ms` (negative values count as 0 ms)."""
    return bisect.bisect_right(EDGES_MS, max(value_ms, 0.0))


def column(metric: str, bucket: int) -> str:
    return f"{metric}_b{bucket:02d}"


COLUMNS: dict[str, tuple[str, ...]] = {m: tuple(column(m, b) for b in range(BUCKETS)) for m in METRICS}


def bucket_bounds(bucket: int) -> tuple[float, float]:
    """[low, high) in ms; the open last bucket reports its low edge twice (no upper bound is known)."""
    low = 0.0 if bucket == 0 else EDGES_MS[bucket - 1]
    high = EDGES_MS[bucket] if bucket < len(EDGES_MS) else low
    return low, high


def percentile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q ≤ 1) of the values counted in `counts`, interpolated geometrically inside
    its bucket (linearly in bucket 0); None when nothing was counted."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total  # the value at this rank, counting from the smallest
    seen = 0
    for bucket, count in enumerate(counts):
        if count and seen + count >= rank:
            low, high = bucket_bounds(bucket)
            fraction = (rank - seen) / count
            if bucket == 0 or high == low:
                return low + (high - low) * fraction
            return low * math.exp(math.log(high / low) * fraction)
        seen += count
    return bucket_bounds(len(counts) - 1)[0]
