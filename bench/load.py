"""Load held: N concurrent streaming clients for S seconds through a real `sluice serve` process
against the fake upstream on loopback (issue #14: 300 × 60 s), with accounting on.

Reports errors, requests served, rows lost (requests answered minus `requests` rows once the gateway
has shut down and flushed), and the gateway's resident memory and open descriptors sampled every
second after a warm-up (growth = last sample minus first). The baseline, measured in the same run,
is the same clients against the fake upstream directly.

    sluice bench load [--clients 300] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import print_table, write_results
from bench.fake_upstream import FakeUpstream, serving_in_thread
from bench.gateway_overhead import Endpoint, Measurement, free_port, measure, running

WARMUP_S = 2.0
TOKEN_INTERVAL_S = 0.02  # a stream lasts a little while, so that many are open at once


def process_sample(pid: int) -> tuple[float, int]:
    """(resident memory in MiB, open file descriptors) of a process."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """Samples a process every second on a thread, from `start()` until `stop()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.samples.append(process_sample(self.pid))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(process_sample(self.pid))


def gateway_environment(upstream_url: str, database_url: str, spool_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(
        SLUICE_DATABASE__URL=database_url,
        SLUICE_SERVER__SPOOL_DIR=spool_dir,
        SLUICE_SERVER__ALLOW_ANONYMOUS="true",  # loopback only
        SLUICE_SERVER__ANONYMOUS_RPM="0",
        SLUICE_SERVER__ANONYMOUS_TPM="0",
        SLUICE_SERVER__ANONYMOUS_SPEND_PER_DAY_USD="0",
        SLUICE_SERVER__DEFAULT_TIER="small",
        SLUICE_TIERS__SMALL__URL=upstream_url,
        SLUICE_TIERS__LARGE__URL=upstream_url,
        SLUICE_POLICIES__DEFAULT__CACHE="off",
    )
    return env


async def _measure_with(endpoint: Endpoint, clients: int, seconds: float, during: Callable[[], None]) -> Measurement:
    task = asyncio.ensure_future(measure(endpoint, True, clients, 10**9, seconds))
    await asyncio.sleep(min(WARMUP_S, seconds / 2))
    during()
    return await task


def run_load(clients: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """Hold the load through a gateway and against the upstream directly; the figures."""
    upstream = FakeUpstream(token_interval_s=TOKEN_INTERVAL_S)
    database = workdir / "sluice.db"
    with serving_in_thread(upstream) as upstream_url:
        host, port = upstream_url.removeprefix("http://").split(":")
        baseline = Endpoint("direct", host, int(port), "none")
        direct = asyncio.run(measure(baseline, True, clients, 10**9, min(seconds, 10)))
        gateway_port = free_port()
        env = gateway_environment(upstream_url, f"sqlite+aiosqlite:///{database}", str(workdir / "spool"))
        command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(gateway_port), "--log-level", "warning"]
        cpus = set(os.sched_getaffinity(0))
        with running(command, gateway_port, cpus, workdir / "gateway.log", env=env, timeout_s=120) as process:
            sampler = Sampler(process.pid)
            endpoint = Endpoint("sluice", "127.0.0.1", gateway_port, "sk-load-test")
            result = asyncio.run(_measure_with(endpoint, clients, seconds, sampler.start))
            sampler.stop()
        # `running` stopped the gateway (SIGTERM): its accounting writer flushed on the way out.
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT count(*), sum(status = 200) FROM requests").fetchone()
    answered = len(result.latencies_s) + result.errors
    first, last = sampler.samples[0], sampler.samples[-1]
    return {
        "clients": clients,
        "seconds": seconds,
        "token_interval_ms": TOKEN_INTERVAL_S * 1000,
        "sluice": result.figures(),
        "direct_upstream_baseline": direct.figures(),
        "accounting_rows": rows[0],
        "accounting_rows_status_200": rows[1] or 0,
        # Every request that reached the gateway leaves one row; a dropped connection may leave a row
        # for a request the client counted as an error, never fewer rows than answers.
        "rows_lost": max(0, answered - rows[0]),
        "rss_mib_first": first[0],
        "rss_mib_last": last[0],
        "rss_mib_growth": last[0] - first[0],
        "fds_first": first[1],
        "fds_last": last[1],
        "fds_growth": last[1] - first[1],
        "samples_rss_mib_fds": sampler.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="sluice bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-load-") as directory:
        figures = run_load(args.clients, args.seconds, Path(directory))
    s, d = figures["sluice"], figures["direct_upstream_baseline"]
    print_table(
        f"{args.clients} streaming clients × {args.seconds:.0f} s (measured on a shared machine)",
        ["target", "streams ok", "errors", "streams/s", "p99 ms", "rows lost", "RSS growth MiB", "fd growth"],
        [
            ["direct upstream (baseline)", d["requests_ok"], d["errors"], d["rps"], d["latency_p99_ms"], "", "", ""],
            [
                "sluice",
                s["requests_ok"],
                s["errors"],
                s["rps"],
                s["latency_p99_ms"],
                figures["rows_lost"],
                figures["rss_mib_growth"],
                figures["fds_growth"],
            ],
        ],
    )
    figures["ratio_streams_per_s_sluice_over_direct"] = s["rps"] / d["rps"] if d["rps"] else None
    write_results("load", figures)


if __name__ == "__main__":
    main()
