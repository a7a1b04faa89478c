"""What the gateway costs on top of its upstream, next to LiteLLM proxy on the same upstream.

One run measures requests/s and p50/p99 latency (and time to first event for streams) at 1 and 8
concurrent clients, plain and streaming, for three targets sharing one fake upstream
(`bench.fake_upstream`, a fixed answer, so only gateway work differs):

  direct   the fake upstream itself (the baseline);
  sluice   the gateway (one uvicorn worker, uvloop + httptools) with a virtual key, budgets and
           generous rate limits in Redis, and Postgres accounting on, in a fresh database this
           script creates, migrates and drops;
  litellm  LiteLLM proxy (one worker, no database, a master key) installed into a cached venv.

The load generator is this process (raw asyncio sockets, HTTP/1.1 keep-alive, one connection per
client), never the servers' event loop. On a 2-core machine the gateway under test gets core 1 to
itself while the load generator and the fake upstream share core 0; Sluice and LiteLLM get the
same placement. Redis and Postgres are system services and float.

Each cell is measured in `--rounds` consecutive rounds (default 5). Targets are judged on the p99
over all of a cell's requests (what clients see); beside it, the median of the rounds' p99s, the
figure least moved when the machine's other work (or its hypervisor) slows a round down.

The gateway's tiers are configured as docker-compose configures them: an upstream URL and the
tier's real tokenizer, so prompt tokens are counted (chat template applied) as in production.

Besides latency, each cell reports the CPU time the server's processes spent per request: on a
machine shared with other work, latency and throughput move with the load, CPU per request hardly.
`--profile` samples Sluice with py-spy under 8 clients and adds its hottest frames to the results.

    python -m bench.gateway_overhead [--quick] [--targets direct,sluice,litellm] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench import litellm_env
from bench.common import RESULTS_DIR, percentile, print_table, write_results

PYTHON = sys.executable
REPO_ROOT = Path(__file__).resolve().parents[1]
POSTGRES_ADMIN_URL = os.environ.get("SLUICE_BENCH_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SLUICE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
# A tier named outright: this measures the gateway path, not the router's classifier.
MODEL = "sluice-small"
PROMPT = "Say hello in one short sentence."
CONCURRENCIES = (1, 8)
MODES = ("plain", "stream")
TARGETS = ("direct", "sluice", "litellm")
# Reported against: added latency at 1 client with accounting on, throughput against LiteLLM at 8.
TARGET_ADDED_P50_MS = 1.5
TARGET_ADDED_P99_MS = 5.0
TARGET_THROUGHPUT_RATIO = 6.0


# --- the load generator -------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    name: str
    host: str
    port: int
    api_key: str

    def request_bytes(self, stream: bool) -> bytes:
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        payload = msgspec.json.encode(body)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"authorization: Bearer {self.api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload


@dataclass
class Measurement:
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    elapsed_s: float = 0.0
    server_cpu_s: float | None = None
    round_p99s_ms: list[float] = field(default_factory=list)  # one p99 per measured round

    def figures(self) -> dict[str, Any]:
        ms = [x * 1000 for x in self.latencies_s]
        figures: dict[str, Any] = {
            "requests_ok": len(ms),
            "errors": self.errors,
            "rps": len(ms) / self.elapsed_s if self.elapsed_s else 0.0,
            "latency_p50_ms": percentile(ms, 50),
            "latency_p99_ms": percentile(ms, 99),
        }
        if self.round_p99s_ms:
            figures["latency_p99_ms_median_of_rounds"] = statistics.median(self.round_p99s_ms)
            figures["latency_p99_ms_by_round"] = self.round_p99s_ms
        if self.ttfts_s:
            ttft = [x * 1000 for x in self.ttfts_s]
            figures |= {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99)}
        if self.server_cpu_s is not None and ms:
            figures["server_cpu_ms_per_request"] = 1000 * self.server_cpu_s / len(ms)
        if self.first_error:
            figures["first_error"] = self.first_error
        return figures


class HttpError(Exception):
    pass


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, float | None, bool]:
    """(status, body, time the first SSE event arrived, whether the server keeps the connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    keep_alive = headers.get("connection") != "close"
    first_event: float | None = None
    if "chunked" in headers.get("transfer-encoding", ""):
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            data = await reader.readexactly(size + 2)
            if first_event is None and b"data:" in data:
                first_event = time.perf_counter()
            body += data[:-2]
        return status, bytes(body), first_event, keep_alive
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body, keep_alive = await reader.read(), False
    if b"data:" in body:
        first_event = time.perf_counter()
    return status, body, first_event, keep_alive


async def _client(
    endpoint: Endpoint, request: bytes, stream: bool, budget: list[int], deadline: float, result: Measurement
) -> None:
    """One keep-alive connection sending requests back to back until the shared budget or time runs out."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        while budget[0] > 0 and time.perf_counter() < deadline:
            budget[0] -= 1
            start = time.perf_counter()
            writer.write(request)
            try:
                status, body, first_event, keep_alive = await _read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                status, body, first_event, keep_alive = 0, f"connection lost: {exc!r}".encode(), None, False
            end = time.perf_counter()
            ok = status == 200 and (not stream or body.rstrip().endswith(b"data: [DONE]"))
            if ok:
                result.latencies_s.append(end - start)
                if stream and first_event is not None:
                    result.ttfts_s.append(first_event - start)
            else:
                result.errors += 1
                result.first_error = result.first_error or f"HTTP {status}: {body[:300].decode(errors='replace')}"
            if not keep_alive:
                writer.close()
                reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    finally:
        writer.close()


async def measure(endpoint: Endpoint, stream: bool, concurrency: int, max_requests: int, seconds: float) -> Measurement:
    result = Measurement()
    request = endpoint.request_bytes(stream)
    budget = [max_requests]
    start = time.perf_counter()
    await asyncio.gather(
        *(_client(endpoint, request, stream, budget, start + seconds, result) for _ in range(concurrency))
    )
    result.elapsed_s = time.perf_counter() - start
    return result


async def check_answers(endpoint: Endpoint) -> None:
    """One plain and one streamed request must succeed before anything is measured."""
    for stream in (False, True):
        probe = await measure(endpoint, stream, 1, 1, 30.0)
        if probe.errors or not probe.latencies_s:
            raise HttpError(
                f"{endpoint.name} does not answer a {'streamed' if stream else 'plain'} chat "
                f"completion: {probe.first_error or 'no response'}"
            )


async def measure_rounds(
    endpoint: Endpoint, stream: bool, concurrency: int, max_requests: int, seconds: float, rounds: int
) -> Measurement:
    """`rounds` consecutive measurements of `seconds / rounds` each, pooled, with each round's p99 kept."""
    pooled = Measurement()
    for _ in range(rounds):
        one = await measure(endpoint, stream, concurrency, max_requests, seconds / rounds)
        pooled.latencies_s += one.latencies_s
        pooled.ttfts_s += one.ttfts_s
        pooled.errors += one.errors
        pooled.first_error = pooled.first_error or one.first_error
        pooled.elapsed_s += one.elapsed_s
        if one.latencies_s:
            pooled.round_p99s_ms.append(percentile([x * 1000 for x in one.latencies_s], 99))
    return pooled


def run_cells(
    endpoint: Endpoint,
    seconds: float,
    warmup_s: float,
    max_requests: int,
    server_group: int | None = None,
    rounds: int = 1,
) -> dict[str, dict[int, Measurement]]:
    """Every mode and concurrency against one endpoint, each in `rounds` rounds; with `server_group`,
    also the CPU time the server's process group spent per request (robust to other load on the
    machine, unlike latency)."""

    async def run_all() -> dict[str, dict[int, Measurement]]:
        await check_answers(endpoint)
        cells: dict[str, dict[int, Measurement]] = {}
        for mode in MODES:
            for concurrency in CONCURRENCIES:
                await measure(endpoint, mode == "stream", concurrency, max_requests, warmup_s)
                cpu_before = group_cpu_seconds(server_group) if server_group else None
                cell = await measure_rounds(endpoint, mode == "stream", concurrency, max_requests, seconds, rounds)
                if cpu_before is not None and server_group:
                    cell.server_cpu_s = group_cpu_seconds(server_group) - cpu_before
                cells.setdefault(mode, {})[concurrency] = cell
                figures = cell.figures()
                cpu = f"  server CPU {figures['server_cpu_ms_per_request']:.2f} ms/req" if cell.server_cpu_s else ""
                print(
                    f"  {endpoint.name:8} {mode:6} c={concurrency}: {figures['rps']:8.0f} req/s"
                    f"  p50 {figures['latency_p50_ms']:.2f} ms{cpu}  errors {cell.errors}",
                    flush=True,
                )
        return cells

    return _run_loop(run_all())


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in the process group (a server and its workers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp, ..., utime (14th field overall), stime (15th).
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _CLOCK_TICKS


def _run_loop(coroutine: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


# --- processes under test -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_layout() -> tuple[set[int], set[int]]:
    """(cores for the load generator and fake upstream, cores for the gateway under test)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening:\n{_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listening on port {port} after {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


@contextlib.contextmanager
def running(
    command: list[str], port: int, cpus: set[int], log: Path, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process pinned to `cpus`, wait until it listens, and always stop it."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True
        )
    try:
        os.sched_setaffinity(process.pid, cpus)
        wait_for_port(port, process, timeout_s, log)
        yield process
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the server and the children it spawned (its own process group, created above)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


# --- Sluice: a fresh Postgres database, a key, generous limits ----------------------------------


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """Create and migrate a uniquely named database; drop it afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import NullPool

    from gateway.db.migrate import upgrade_async

    admin_url = sa.make_url(POSTGRES_ADMIN_URL)
    name = f"sluice_bench_{uuid.uuid4().hex[:12]}"
    url = admin_url.set(database=name).render_as_string(hide_password=False)

    async def admin(statement: str) -> None:
        engine = create_async_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        try:
            async with engine.connect() as connection:
                await connection.execute(sa.text(statement))
        finally:
            await engine.dispose()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        asyncio.run(upgrade_async(url))
        yield url
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def create_bench_key(database_url: str) -> str:
    """A virtual key whose limits never bind during the run, so every check runs but none refuses."""
    from gateway import keys
    from gateway.db.database import make_database

    async def create() -> keys.CreatedKey:
        engine = make_database(database_url)
        try:
            return await keys.create_key(
                engine,
                tenant="bench",
                feature="gateway-overhead",
                name="bench",
                policy={"rpm": 10_000_000, "tpm": 1_000_000_000, "spend_per_day_usd": 1_000_000.0},
            )
        finally:
            await engine.dispose()

    return asyncio.run(create()).secret


def sluice_environment(upstream_url: str, database_url: str, spool_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(
        SLUICE_DATABASE__URL=database_url,
        SLUICE_REDIS__URL=REDIS_URL,
        SLUICE_SERVER__SPOOL_DIR=spool_dir,
        SLUICE_SERVER__DEFAULT_TIER="small",
        SLUICE_TIERS__SMALL__URL=upstream_url,
        SLUICE_TIERS__LARGE__URL=upstream_url,
        # As docker-compose configures the gateway: each tier's real tokenizer counts prompt tokens
        # (chat template applied), which is work production requests pay for.
        SLUICE_TIERS__SMALL__TOKENIZER="small",
        SLUICE_TIERS__LARGE__TOKENIZER="large",
        # The cache would answer repeated prompts without the upstream: this measures the full path.
        SLUICE_POLICIES__DEFAULT__CACHE="off",
        SLUICE_POLICIES__DEFAULT__RPM="10000000",
        SLUICE_POLICIES__DEFAULT__TPM="1000000000",
        SLUICE_POLICIES__DEFAULT__SPEND_PER_DAY_USD="1000000.0",
    )
    return env


# --- where Sluice spends its time ---------------------------------------------------------------


def profile_process(pid: int, endpoint: Endpoint, seconds: float) -> dict[str, list[dict[str, Any]]]:
    """Sample the server with py-spy while 8 clients send plain requests; its hottest frames."""
    py_spy = shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if py_spy is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy==0.4.1")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    collapsed = RESULTS_DIR / "gateway_overhead_profile.txt"
    duration = max(2, int(seconds))
    record = [
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(duration),
        "--rate",
        "200",
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(collapsed),
    ]
    with subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as spy:
        _run_loop(measure(endpoint, False, 8, 10**9, duration + 1.0))
        spy.wait(timeout=60)
    print(f"  py-spy collapsed stacks: {collapsed}", flush=True)
    return hot_frames(collapsed)


PROJECT_SOURCES = ("(gateway/", "(router/", "(engines/")


def hot_frames(collapsed: Path, top: int = 25) -> dict[str, list[dict[str, Any]]]:
    """Sluice's own frames by inclusive share of samples (the frame and what it calls), and every
    frame by self share (where the interpreter actually was)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return {}
    ours = [(f, n) for f, n in inclusive.most_common() if any(src in f for src in PROJECT_SOURCES)][:top]
    by_package: Counter[str] = Counter()
    for frame, n in own.items():
        location = frame.rpartition(" (")[2]
        by_package[location.split("/", 1)[0] if "/" in location else location.split(":", 1)[0]] += n
    return {
        "self_pct_by_package": [{"package": k, "pct": round(100 * n / total, 1)} for k, n in by_package.most_common()],
        "sluice_frames_by_inclusive_pct": [{"frame": f, "pct": round(100 * n / total, 1)} for f, n in ours],
        "all_frames_by_self_pct": [{"frame": f, "pct": round(100 * n / total, 1)} for f, n in own.most_common(top)],
    }


# --- the run ------------------------------------------------------------------------------------


def summarise(results: dict[str, dict[str, dict[int, Measurement]]]) -> dict[str, Any]:
    """Per mode and concurrency: every target's figures, added latency over direct, Sluice/LiteLLM ratio."""
    summary: dict[str, Any] = {}
    for mode in MODES:
        for concurrency in CONCURRENCIES:
            cell: dict[str, Any] = {}
            direct = results.get("direct", {}).get(mode, {}).get(concurrency)
            for target in TARGETS:
                measured = results.get(target, {}).get(mode, {}).get(concurrency)
                if measured is None:
                    continue
                figures = measured.figures()
                if direct is not None and target != "direct":
                    base = direct.figures()
                    figures["added_latency_p50_ms_over_direct"] = figures["latency_p50_ms"] - base["latency_p50_ms"]
                    figures["added_latency_p99_ms_over_direct"] = figures["latency_p99_ms"] - base["latency_p99_ms"]
                    if "latency_p99_ms_median_of_rounds" in figures and "latency_p99_ms_median_of_rounds" in base:
                        figures["added_latency_p99_ms_over_direct_median_of_rounds"] = (
                            figures["latency_p99_ms_median_of_rounds"] - base["latency_p99_ms_median_of_rounds"]
                        )
                    if "ttft_p50_ms" in figures and "ttft_p50_ms" in base:
                        figures["added_ttft_p50_ms_over_direct"] = figures["ttft_p50_ms"] - base["ttft_p50_ms"]
                        figures["added_ttft_p99_ms_over_direct"] = figures["ttft_p99_ms"] - base["ttft_p99_ms"]
                cell[target] = figures
            if "sluice" in cell and "litellm" in cell and cell["litellm"]["rps"]:
                cell["throughput_ratio_sluice_over_litellm"] = cell["sluice"]["rps"] / cell["litellm"]["rps"]
                cpu_sluice = cell["sluice"].get("server_cpu_ms_per_request")
                cpu_litellm = cell["litellm"].get("server_cpu_ms_per_request")
                if cpu_sluice and cpu_litellm:
                    cell["cpu_per_request_ratio_litellm_over_sluice"] = cpu_litellm / cpu_sluice
            summary.setdefault(mode, {})[f"{concurrency}_clients"] = cell
    return summary


def against_targets(summary: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    one = summary.get("plain", {}).get("1_clients", {}).get("sluice")
    if one and "added_latency_p50_ms_over_direct" in one:
        checks["sluice_added_p50_ms_at_1_client_plain"] = {
            "measured": one["added_latency_p50_ms_over_direct"],
            "target_at_most": TARGET_ADDED_P50_MS,
            "met": one["added_latency_p50_ms_over_direct"] <= TARGET_ADDED_P50_MS,
        }
        # Judged on the p99 of all the cell's requests (what clients see); the median of the rounds'
        # p99s stands beside it as the figure least moved by other work on the machine.
        pooled_p99 = one["added_latency_p99_ms_over_direct"]
        checks["sluice_added_p99_ms_at_1_client_plain"] = {
            "measured": pooled_p99,
            "measured_as": "p99 of all the cell's requests (pooled over rounds)",
            "median_of_rounds_p99": one.get("added_latency_p99_ms_over_direct_median_of_rounds"),
            "target_at_most": TARGET_ADDED_P99_MS,
            "met": pooled_p99 <= TARGET_ADDED_P99_MS,
        }
    ratio = summary.get("plain", {}).get("8_clients", {}).get("throughput_ratio_sluice_over_litellm")
    if ratio is not None:
        checks["throughput_ratio_sluice_over_litellm_at_8_clients_plain"] = {
            "measured": ratio,
            "target_at_least": TARGET_THROUGHPUT_RATIO,
            "met": ratio >= TARGET_THROUGHPUT_RATIO,
        }
    return checks


def print_summary(summary: dict[str, Any]) -> None:
    header = [
        "mode",
        "clients",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p99 med/rounds",
        "+p50 ms",
        "+p99 ms",
        "+p99 med/rounds",
        "ttft p50",
        "+ttft p50",
        "server CPU ms/req",
        "errors",
    ]
    rows = []
    for mode, by_concurrency in summary.items():
        for clients, cell in by_concurrency.items():
            for target in TARGETS:
                f = cell.get(target)
                if f is None:
                    continue
                rows.append(
                    [
                        mode,
                        clients.split("_")[0],
                        target,
                        f["rps"],
                        f["latency_p50_ms"],
                        f["latency_p99_ms"],
                        f.get("latency_p99_ms_median_of_rounds", "-"),
                        f.get("added_latency_p50_ms_over_direct", "-"),
                        f.get("added_latency_p99_ms_over_direct", "-"),
                        f.get("added_latency_p99_ms_over_direct_median_of_rounds", "-"),
                        f.get("ttft_p50_ms", "-"),
                        f.get("added_ttft_p50_ms_over_direct", "-"),
                        f.get("server_cpu_ms_per_request", "-"),
                        f["errors"],
                    ]
                )
    print_table("Gateway overhead (fake upstream, loopback)", header, rows)
    ratios = [
        [m, c.split("_")[0], cell["throughput_ratio_sluice_over_litellm"]]
        for m, by_c in summary.items()
        for c, cell in by_c.items()
        if "throughput_ratio_sluice_over_litellm" in cell
    ]
    if ratios:
        print_table("Throughput Sluice / LiteLLM", ["mode", "clients", "ratio"], ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short cells (~1 minute in all)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of direct,sluice,litellm")
    parser.add_argument("--seconds", type=float, help="measured seconds per cell (default 8; --quick 2)")
    parser.add_argument("--max-requests", type=int, default=200_000, help="upper bound on requests per cell")
    parser.add_argument(
        "--profile", action="store_true", help="also sample Sluice with py-spy under 8 clients (hot frames in the JSON)"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--rounds", type=int, help="rounds per cell, each reporting its own p99 (default 5; --quick 1)")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    if unknown := set(targets) - set(TARGETS):
        parser.error(f"unknown targets {sorted(unknown)}")
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    warmup_s = 0.5 if args.quick else 1.5
    rounds = args.rounds or (1 if args.quick else 5)
    if rounds < 1:
        parser.error("--rounds must be at least 1")

    load_at_start = os.getloadavg()
    loadgen_cpus, gateway_cpus = cpu_layout()
    if args.no_pin:
        loadgen_cpus = gateway_cpus = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, loadgen_cpus)
    print(f"load generator + fake upstream on cores {sorted(loadgen_cpus)}; gateway on cores {sorted(gateway_cpus)}")

    results: dict[str, dict[str, dict[int, Measurement]]] = {}
    failures: dict[str, str] = {}
    profile: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        logs = Path(tmp)
        upstream_port = free_port()
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        with running(
            [PYTHON, "-m", "bench.fake_upstream", "--port", str(upstream_port)],
            upstream_port,
            loadgen_cpus,
            logs / "upstream.log",
        ) as upstream:
            for target in targets:
                print(f"\n[{target}]", flush=True)
                try:
                    results[target] = _run_target(
                        target,
                        upstream.pid,
                        upstream_port,
                        upstream_url,
                        gateway_cpus,
                        logs,
                        seconds,
                        warmup_s,
                        args.max_requests,
                        rounds,
                        profile if args.profile else None,
                    )
                except (RuntimeError, HttpError, subprocess.CalledProcessError, ImportError, OSError) as exc:
                    failures[target] = f"{type(exc).__name__}: {exc}"
                    print(f"  {target} not measured: {failures[target]}", file=sys.stderr, flush=True)

    summary = summarise(results)
    print_summary(summary)
    checks = against_targets(summary)
    for name, check in checks.items():
        print(f"{name}: {check['measured']:.3g} ({'met' if check['met'] else 'NOT met'})")
    # A quick or partial run never overwrites the figures of a full one.
    name = "gateway_overhead" + ("_quick" if args.quick else "")
    name += "" if set(targets) == set(TARGETS) else "_" + "_".join(targets)
    write_results(
        name,
        {
            "setup": {
                "upstream": "bench.fake_upstream (fixed answer of 10 tokens; streams 13 SSE events with usage)",
                "request": {"model": MODEL, "prompt": PROMPT, "max_tokens": 16},
                "load_generator": "separate process, raw asyncio sockets, HTTP/1.1 keep-alive, a connection per client",
                "cores_load_generator_and_upstream": sorted(loadgen_cpus),
                "cores_gateway_under_test": sorted(gateway_cpus),
                # Other work on the machine skews every figure: compare runs at similar load only.
                "load_average_1_5_15_min_at_start": load_at_start,
                "load_average_1_5_15_min_at_end": os.getloadavg(),
                "seconds_per_cell": seconds,
                "warmup_seconds_per_cell": warmup_s,
                "rounds_per_cell": rounds,
                "sluice": "one uvicorn worker (uvloop, httptools), virtual key, Redis limits, Postgres accounting, "
                "tiers with their real tokenizers (as docker-compose)",
                "litellm": f"litellm[proxy]=={litellm_env.LITELLM_VERSION}, one worker, no database, master key",
                "targets": {
                    "added_p50_ms_at_1_client_at_most": TARGET_ADDED_P50_MS,
                    "added_p99_ms_at_1_client_at_most": TARGET_ADDED_P99_MS,
                    "throughput_ratio_over_litellm_at_8_clients_at_least": TARGET_THROUGHPUT_RATIO,
                },
            },
            "results": summary,
            "against_targets": checks,
            "not_measured": failures,
            **({"sluice_profile_hot_frames_8_clients_plain": profile} if profile else {}),
        },
    )
    return 1 if failures else 0


def _run_target(
    target: str,
    upstream_pid: int,
    upstream_port: int,
    upstream_url: str,
    cpus: set[int],
    logs: Path,
    seconds: float,
    warmup_s: float,
    max_requests: int,
    rounds: int,
    profile: dict[str, Any] | None = None,
) -> dict[str, dict[int, Measurement]]:
    if target == "direct":
        direct = Endpoint("direct", "127.0.0.1", upstream_port, "sk-upstream")
        return run_cells(direct, seconds, warmup_s, max_requests, server_group=upstream_pid, rounds=rounds)
    port = free_port()
    if target == "sluice":
        with fresh_postgres_database() as database_url:
            key = create_bench_key(database_url)
            env = sluice_environment(upstream_url, database_url, str(logs / "spool"))
            command = [
                PYTHON,
                "-m",
                "gateway.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
            endpoint = Endpoint("sluice", "127.0.0.1", port, key)
            with running(command, port, cpus, logs / "sluice.log", env=env) as process:
                cells = run_cells(endpoint, seconds, warmup_s, max_requests, server_group=process.pid, rounds=rounds)
                if profile is not None:
                    profile.update(profile_process(process.pid, endpoint, seconds))
                return cells
    litellm_bin = litellm_env.ensure_venv()
    config = litellm_env.write_config(logs / "litellm.yaml", upstream_url, [MODEL])
    command = litellm_env.proxy_command(litellm_bin, config, port)
    endpoint = Endpoint("litellm", "127.0.0.1", port, litellm_env.MASTER_KEY)
    with running(
        command, port, cpus, logs / "litellm.log", env=litellm_env.proxy_environment(), timeout_s=180
    ) as process:
        return run_cells(endpoint, seconds, warmup_s, max_requests, server_group=process.pid, rounds=rounds)


if __name__ == "__main__":
    raise SystemExit(main())
