"""Colocated serving against separate prefill and decode pools, planned by simulation.

The step costs come from the real engine on this machine (`measure_step_costs`: prefill chunks of
several sizes, decode steps at several batch sizes and context lengths, fitted by least squares), or
from a JSON file of a previous measurement (`--costs`). The simulator then replays one request mix
(Poisson arrivals, prompt and output lengths drawn per mix) through:

- colocated replicas: our scheduler's policy — every running sequence decodes each step, and the rest
  of the step's token budget prefills waiting prompts in chunks (so a long prompt lengthens the steps
  of everyone decoding beside it: the inter-token latency cost disaggregation removes);
- disaggregated fleets: prefill replicas run only prefill chunks; a finished prompt's KV blocks travel
  to the least-loaded decode replica (bytes / link bandwidth), which runs only decode steps.

A request is within SLO when its TTFT ≤ the tier's `slo_ttft_p99_ms` and its mean inter-token time
(TPOT, as DistServe defines goodput) ≤ `slo_itl_p99_ms`. Goodput = requests within SLO per second; the
cheapest fleet is the fewest replicas whose SLO attainment is ≥ `--attainment` at the offered rate.

    python -m bench.capacity_sim --tier small --rate 2 --mix chat --mix rag
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import cpu_model, print_table, write_results

# Prompt and output length distributions (lognormal median, sigma, clip) per request mix.
MIXES: dict[str, dict[str, tuple[float, float, int, int]]] = {
    "chat": {"prompt": (250, 0.7, 16, 2048), "output": (180, 0.6, 8, 512)},
    "rag": {"prompt": (1500, 0.4, 256, 3500), "output": (120, 0.5, 8, 400)},
    "summarise": {"prompt": (3000, 0.2, 1024, 3800), "output": (250, 0.4, 32, 600)},
}


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step: base + per prefill token + per decoding sequence + per context token read."""

    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    kv_bytes_per_token: int

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_context_token_s * context_tokens
        )


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass
class Replica:
    """One engine replica's queue and batch; `role`: colocated | prefill | decode."""

    role: str
    max_num_seqs: int
    max_num_batched_tokens: int
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    busy_until: float = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)


def draw_requests(mix: str, rate: float, duration_s: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    shape = MIXES[mix]

    def draw(kind: str) -> int:
        median, sigma, low, high = shape[kind]
        return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))

    requests, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= duration_s:
            return requests
        requests.append(Request(arrival=now, prompt=draw("prompt"), output=draw("output")))


def _schedule(replica: Replica) -> tuple[list[Request], list[tuple[Request, int]]]:
    """(sequences decoding this step, (sequence, prefill chunk) pairs) under the replica's budgets."""
    decoding = [r for r in replica.running if r.prefilled == r.prompt] if replica.role != "prefill" else []
    budget = replica.max_num_batched_tokens - len(decoding)
    chunks: list[tuple[Request, int]] = []
    if replica.role == "decode":
        return decoding, chunks
    for request in [r for r in replica.running if r.prefilled < r.prompt] + replica.waiting:
        if budget <= 0:
            break
        if request in replica.waiting:
            if len(replica.running) >= replica.max_num_seqs:
                break
            replica.waiting.remove(request)
            replica.running.append(request)
        chunk = min(budget, request.prompt - request.prefilled)
        chunks.append((request, chunk))
        budget -= chunk
    return decoding, chunks


def simulate(
    requests: Sequence[Request],
    cost: StepCost,
    *,
    colocated: int = 0,
    prefill: int = 0,
    decode: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    link_gb_s: float = 10.0,
) -> list[Request]:
    """Replay `requests` (copies) through a fleet; returns them with their token times filled in."""
    reqs = [Request(r.arrival, r.prompt, r.output) for r in requests]
    roles = ["colocated"] * colocated + ["prefill"] * prefill + ["decode"] * decode
    replicas = [Replica(role, max_num_seqs, max_num_batched_tokens) for role in roles]
    entry = [r for r in replicas if r.role in ("colocated", "prefill")]
    decoders = [r for r in replicas if r.role == "decode"]
    # Events: (time, order, kind, payload). Kinds: arrive (request), handoff (request), step (replica index).
    events: list[tuple[float, int, str, object]] = [(r.arrival, i, "arrive", r) for i, r in enumerate(reqs)]
    heapq.heapify(events)
    order = len(events)
    idle = set(range(len(replicas)))

    def wake(index: int, now: float) -> None:
        nonlocal order
        if index in idle:
            idle.discard(index)
            order += 1
            heapq.heappush(events, (max(now, replicas[index].busy_until), order, "step", index))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            target = min(range(len(replicas)), key=lambda i: (replicas[i] not in entry, replicas[i].load))
            replicas[target].waiting.append(payload)  # type: ignore[arg-type]
            wake(target, now)
            continue
        if kind == "handoff":
            target = min(range(len(replicas)), key=lambda i: (replicas[i] not in decoders, replicas[i].load))
            replicas[target].running.append(payload)  # type: ignore[arg-type]
            wake(target, now)
            continue
        index = payload  # a step
        replica = replicas[index]  # type: ignore[index]
        decoding, chunks = _schedule(replica)
        if not decoding and not chunks:
            idle.add(index)  # type: ignore[arg-type]
            continue
        context = sum(r.context for r in decoding)
        done = now + cost.step_s(sum(c for _, c in chunks), len(decoding), context)
        for request in decoding:
            request.generated += 1
            if request.generated >= request.output:
                request.finished_at = done
                replica.running.remove(request)
        for request, chunk in chunks:
            request.prefilled += chunk
            if request.prefilled == request.prompt:
                request.first_token_at = done  # the prefill step samples the first token
                request.generated = 1
                if replica.role == "prefill":
                    replica.running.remove(request)
                    order += 1
                    transfer = request.prompt * cost.kv_bytes_per_token / (link_gb_s * 1e9)
                    heapq.heappush(events, (done + transfer, order, "handoff", request))
                elif request.generated >= request.output:
                    request.finished_at = done
                    replica.running.remove(request)
        replica.busy_until = done
        order += 1
        heapq.heappush(events, (done, order, "step", index))
    return reqs


def slo_report(done: Sequence[Request], duration_s: float, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, float]:
    served = [r for r in done if r.finished_at is not None and r.first_token_at is not None]
    ttfts = np.array([r.first_token_at - r.arrival for r in served])  # type: ignore[operator]
    tpots = np.array([(r.finished_at - r.first_token_at) / max(1, r.output - 1) for r in served])  # type: ignore[operator]
    within = int(np.sum((ttfts <= ttft_slo_s) & (tpots <= tpot_slo_s))) if served else 0
    return {
        "requests": len(done),
        "served": len(served),
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if served else math.inf,
        "tpot_p99_s": float(np.percentile(tpots, 99)) if served else math.inf,
        "slo_attainment": within / len(done) if done else 0.0,
        "goodput_rps": within / duration_s,
    }


def cheapest_fleet(
    requests: Sequence[Request], cost: StepCost, duration_s: float, slos: tuple[float, float], attainment: float,
    max_replicas: int, **engine: int,
) -> dict[str, object]:
    """The fewest replicas meeting `attainment`, colocated and disaggregated (None when none up to the cap)."""
    best: dict[str, object] = {"colocated": None, "disaggregated": None}
    for total in range(1, max_replicas + 1):
        if best["colocated"] is None:
            report = slo_report(simulate(requests, cost, colocated=total, **engine), duration_s, *slos)
            if report["slo_attainment"] >= attainment:
                best["colocated"] = {"replicas": total, **report}
        if best["disaggregated"] is None and total >= 2:
            for prefill in range(1, total):
                report = slo_report(
                    simulate(requests, cost, prefill=prefill, decode=total - prefill, **engine), duration_s, *slos
                )
                if report["slo_attainment"] >= attainment:
                    best["disaggregated"] = {"replicas": total, "prefill": prefill, "decode": total - prefill, **report}
                    break
        if all(v is not None for v in best.values()):
            break
    return best


def measure_step_costs(tier: str, threads: int | None) -> StepCost:
    """Fit `StepCost` to timed steps of the real engine (prefix caching off so every prompt is computed)."""
    from engines.config import EngineConfig
    from engines.llm_engine import LLMEngine
    from engines.model_runner import kv_block_bytes
    from engines.registry import resolve_model
    from engines.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(resolve_model(tier)), quantization="auto", kv_cache_dtype="auto",
                                    enable_prefix_caching=False, max_num_seqs=32, max_num_batched_tokens=512,
                                    num_threads=threads, kv_cache_bytes=1 << 30))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    rows: list[tuple[int, int, int, float]] = []  # prefill tokens, decode seqs, context tokens, seconds
    counter = 0

    def add(prompt_len: int, max_tokens: int) -> None:
        nonlocal counter
        counter += 1
        ids = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        engine.add_request(f"m{counter}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    for prompt_len in (32, 128, 256, 512, 32, 512):
        add(prompt_len, 1)
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        rows.append((prompt_len, 0, 0, time.perf_counter() - started))
    for batch in (1, 4, 16, 32):
        for context in (128, 1024):
            for _ in range(batch):
                add(context, 6)
            while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running + list(engine.scheduler.waiting)):
                engine.step()
            for _ in range(4):
                started = time.perf_counter()
                outputs = engine.step()
                rows.append((0, len(outputs), batch * context, time.perf_counter() - started))
            while engine.has_unfinished_requests():
                engine.step()
    x = np.array([[1.0, p, d, c] for p, d, c, _ in rows])
    y = np.array([s for *_, s in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative marginal cost is noise
    kv_bytes = kv_block_bytes(engine.model_config, 16, engine.kv_cache_dtype) // 16
    return StepCost(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), int(kv_bytes))


def main(argv: Sequence[str] | None = None) -> None:
    from gateway.config import load_settings

    parser = argparse.ArgumentParser(prog="sluice bench capacity_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", default="small", help="demo tier whose engine step costs are measured")
    parser.add_argument("--costs", type=Path, help="JSON of a previous measurement (skips measuring)")
    parser.add_argument("--mix", action="append", choices=sorted(MIXES), help="request mix (repeatable)")
    parser.add_argument("--rate", type=float, default=2.0, help="offered load, requests per second")
    parser.add_argument("--duration", type=float, default=300.0, help="simulated seconds of arrivals")
    parser.add_argument("--attainment", type=float, default=0.9, help="SLO attainment a fleet must reach")
    parser.add_argument("--max-replicas", type=int, default=12)
    parser.add_argument("--link-gb-s", type=float, default=10.0, help="KV transfer bandwidth between pools")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    tier = load_settings(environ={}).tiers[args.tier]
    slos = (tier.slo_ttft_p99_ms / 1000, tier.slo_itl_p99_ms / 1000)
    if args.costs:
        cost = StepCost(**json.loads(args.costs.read_text())["step_cost"])
    else:
        cost = measure_step_costs(args.tier, args.threads)
    engine = {"max_num_seqs": tier.max_num_seqs, "max_num_batched_tokens": tier.max_num_batched_tokens}
    results: dict[str, object] = {}
    table = []
    for mix in args.mix or ["chat", "rag"]:
        requests = draw_requests(mix, args.rate, args.duration, seed=0)
        fleets = cheapest_fleet(requests, cost, args.duration, slos, args.attainment, args.max_replicas,
                                link_gb_s=args.link_gb_s, **engine)  # type: ignore[arg-type]
        results[mix] = fleets
        for name, fleet in fleets.items():
            if fleet is None:
                table.append([mix, name, f">{args.max_replicas}", "-", "-", "-", "-"])
                continue
            f = dict(fleet)  # type: ignore[call-overload]
            shape = f"{f['prefill']}P+{f['decode']}D" if name == "disaggregated" else str(f["replicas"])
            table.append([mix, name, shape, f"{f['slo_attainment']:.3f}", f"{f['goodput_rps'] / f['replicas']:.3f}",
                          f"{f['ttft_p99_s']:.2f}", f"{f['tpot_p99_s'] * 1000:.0f}"])
    title = (f"CPU: {cpu_model()}; tier {args.tier}; {args.rate}/s offered; "
             f"SLOs TTFT {slos[0]:.2f} s, TPOT {slos[1] * 1000:.0f} ms")
    header = ["mix", "fleet", "replicas", "attainment", "goodput/replica", "TTFT p99 s", "TPOT p99 ms"]
    print_table(title, header, table)
    write_results("capacity_sim", {
        "cpu": cpu_model(), "tier": args.tier, "rate_rps": args.rate, "duration_s": args.duration,
        "slo_ttft_s": slos[0], "slo_tpot_s": slos[1], "attainment_required": args.attainment,
        "link_gb_s": args.link_gb_s, "step_cost": asdict(cost), "fleets_by_mix": results,
    })


if __name__ == "__main__":
    main()
