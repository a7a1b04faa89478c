"""Interactive latency with a batch running beside it, through the gateway on a real in-process tier.

Three scenarios on one gateway (the tier's model loaded once), each with the same Poisson arrivals of
interactive streamed requests for `--duration` seconds:

  alone        interactive load only (the baseline);
  batch_api    plus `--batch` requests submitted at once through the Batch API (`batch` priority: admitted
               after interactive work, preempted for it; the worker also stops claiming lines while an
               interactive SLO is at risk);
  no_priority  plus the same requests sent as ordinary concurrent requests (`--batch-concurrency` at a
               time): what the batch does to interactive work without priority classes.

Reported per scenario: interactive TTFT p50/p99, SLO attainment (share of interactive requests answered
with TTFT within the tier's `slo_ttft_p99_ms`; refusals count as misses), refusals, and the batch's
completion time (it must complete). Target (issue #12): p99 TTFT with the batch within 1.2x of alone.

    python -m bench.capacity [--tier small] [--rps 0.5] [--duration 60] [--batch 40] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import uvicorn

from bench.common import cpu_model, percentile, print_table, write_results
from gateway.app import create_app
from gateway.config import BatchConfig, PolicyConfig, Settings, load_settings
from gateway.db.migrate import upgrade

TOPICS = ["rivers", "glass", "trains", "bees", "copper", "tides", "maps", "violins", "salt", "comets", "moss"]


@dataclass
class Outcome:
    status: int
    ttft_s: float | None


def bench_settings(tier: str, directory: Path, batch_concurrency: int,
                   max_batch_tokens_beside_interactive: int | None = None) -> Settings:  # fmt: skip
    base = load_settings(environ={})
    database_url = f"sqlite+aiosqlite:///{directory / 'sluice.db'}"
    upgrade(database_url)
    server = msgspec.structs.replace(base.server, allow_anonymous=True, anonymous_rpm=0, anonymous_tpm=0,
                                     anonymous_spend_per_day_usd=0.0, default_tier=tier,
                                     spool_dir=str(directory / "spool"))  # fmt: skip
    return msgspec.structs.replace(
        base, server=server, database=msgspec.structs.replace(base.database, url=database_url),
        tiers={tier: msgspec.structs.replace(base.tiers[tier],
                                             max_batch_tokens_beside_interactive=max_batch_tokens_beside_interactive)},
        policies={"default": PolicyConfig(allowed_tiers=[tier])},
        batch=BatchConfig(dir=str(directory / "batches"), concurrency=batch_concurrency),
    )  # fmt: skip


def chat_body(tier: str, text: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": f"sluice-{tier}", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip


async def interactive_request(http: httpx.AsyncClient, body: dict[str, Any]) -> Outcome:
    started = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(response.status_code, None)
        ttft = None
        async for line in response.aiter_lines():
            if ttft is None and _has_text(line):
                ttft = time.perf_counter() - started
        return Outcome(200, ttft)


def _has_text(line: str) -> bool:
    """An SSE chunk carrying generated text (not the role-only first delta, not usage)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or []
    return any((choice.get("delta") or {}).get("content") for choice in choices)


async def interactive_load(http: httpx.AsyncClient, args: argparse.Namespace, name: str) -> list[Outcome]:
    rng = random.Random(1)  # the same arrival times in every scenario; prompts differ by scenario (prefix cache)
    tasks, clock, end = [], 0.0, args.duration
    while (clock := clock + rng.expovariate(args.rps)) < end:
        text = f"[{name} #{len(tasks)}] In one sentence, what is interesting about {rng.choice(TOPICS)}?"
        body = chat_body(args.tier, text, args.max_tokens, stream=True)
        tasks.append(asyncio.create_task(_after(clock, interactive_request(http, body))))
    return list(await asyncio.gather(*tasks))


async def _after(delay_s: float, work: Any) -> Any:
    await asyncio.sleep(delay_s)
    return await work


def batch_prompts(args: argparse.Namespace, name: str) -> list[str]:
    rng = random.Random(7)
    return [f"[{name} #{i}] Write a short paragraph comparing {rng.choice(TOPICS)} and {rng.choice(TOPICS)}."
            for i in range(args.batch)]  # fmt: skip


async def run_batch_api(http: httpx.AsyncClient, args: argparse.Namespace) -> float:
    prompts = batch_prompts(args, "batch_api")
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat_body(args.tier, text, args.max_tokens)} for i, text in enumerate(prompts)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    started = time.perf_counter()
    uploaded = (await http.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})).json()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = (await http.post("/v1/batches", json=body)).json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.5)
        batch = (await http.get(f"/v1/batches/{batch['id']}")).json()
    assert batch["request_counts"]["completed"] == args.batch, batch
    return time.perf_counter() - started


async def run_plain_batch(http: httpx.AsyncClient, args: argparse.Namespace) -> float:
    gate = asyncio.Semaphore(args.batch_concurrency)

    async def one(text: str) -> None:
        async with gate:
            response = await http.post("/v1/chat/completions", json=chat_body(args.tier, text, args.max_tokens))
            assert response.status_code in (200, 429), response.text

    started = time.perf_counter()
    await asyncio.gather(*(one(text) for text in batch_prompts(args, "no_priority")))
    return time.perf_counter() - started


async def scenario(base_url: str, name: str, args: argparse.Namespace, slo_ttft_s: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        batch = {"alone": None, "batch_api": run_batch_api, "no_priority": run_plain_batch}[name]
        batch_task = asyncio.create_task(batch(http, args)) if batch else None
        outcomes = await interactive_load(http, args, name)
        batch_s = await batch_task if batch_task else None
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    within = sum(1 for t in ttfts if t <= slo_ttft_s)
    return {"scenario": name, "interactive": len(outcomes), "refused": sum(o.status != 200 for o in outcomes),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "slo_attainment": within / len(outcomes) if outcomes else float("nan"), "batch_s": batch_s}  # fmt: skip


def serve(settings: Settings) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.1)
        if not thread.is_alive():
            raise SystemExit("the gateway failed to start")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", default="small")
    parser.add_argument("--rps", type=float, default=0.5, help="interactive arrivals per second (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of interactive arrivals")
    parser.add_argument("--batch", type=int, default=40, help="requests in the batch")
    parser.add_argument("--batch-concurrency", type=int, default=BatchConfig().concurrency,
                        help="batch lines in flight at once (default: the config's `batch.concurrency`)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens-beside-interactive", type=int, default=None,
                        help="the tier's engine setting (default: its spec's)")  # fmt: skip
    parser.add_argument("--scenarios", default="alone,batch_api,no_priority")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-capacity-") as directory:
        settings = bench_settings(args.tier, Path(directory), args.batch_concurrency,
                                  args.max_batch_tokens_beside_interactive)  # fmt: skip
        slo_ttft_s = settings.tiers[args.tier].slo_ttft_p99_ms / 1000
        base_url, server, thread = serve(settings)
        try:
            rows = [asyncio.run(scenario(base_url, name, args, slo_ttft_s)) for name in args.scenarios.split(",")]
        finally:
            server.should_exit = True
            thread.join(60)
    alone = next((row["ttft_p99_s"] for row in rows if row["scenario"] == "alone"), None)
    for row in rows:
        row["ttft_p99_over_alone_x"] = row["ttft_p99_s"] / alone if alone else None
        # The batch ran through every interactive arrival only if it outlasted the arrivals' window.
        row["batch_outlasted_window"] = row["batch_s"] is not None and row["batch_s"] > args.duration
    header = list(rows[0])
    print_table(f"interactive under a batch ({args.tier}, {args.rps} rps, SLO TTFT {slo_ttft_s} s)", header,
                [[row[h] for h in header] for row in rows])  # fmt: skip
    batch_api = next((row for row in rows if row["scenario"] == "batch_api"), None)
    target = None if batch_api is None or alone is None else batch_api["ttft_p99_over_alone_x"] <= 1.2
    write_results("capacity", {"args": vars(args), "cpu": cpu_model(), "slo_ttft_s": slo_ttft_s, "scenarios": rows,
                               "target_batch_api_p99_within_1_2x_of_alone": target})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
