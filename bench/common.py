"""What every benchmark shares: percentiles, a printed table, and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it: every figure carries it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_results(name: str, figures: dict[str, Any]) -> Path:
    """Write bench/results/<name>.json with the run's context beside the figures."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {
        "benchmark": name,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "machine": {"python": platform.python_version(), "cpu": cpu_model()},
        **figures,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"\nwrote {path}")
    return path


def run_without_amx() -> None:
    """From here on, choose and run what a CPU with VNNI and no AMX would (w8a8 on `w8a8_vnni`, attention by
    `vdpbf16ps`): `ATEN_CPU_CAPABILITY=avx512` (`engines.cpu`), for benchmarks that measure that path on an AMX
    CPU beside the one `auto` picks there. Call it before any engine is built."""
    from engines.cpu import ISA_CAP_ENV, cpu_flags

    os.environ[ISA_CAP_ENV] = "avx512"
    cpu_flags.cache_clear()

