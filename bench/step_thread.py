"""Where an in-process engine's PyTorch work runs, and what it costs: one greedy request streamed through
`AsyncLLMEngine` on the tier's shipped spec, in two placements, each in a fresh process:

  step_thread       the engine loaded and stepped on the step thread (`AsyncLLMEngine.build`: what the
                    gateway and `sluice engine` do);
  loaded_elsewhere  the engine loaded on the main thread, then stepped on the step thread (what the
                    gateway did before: it loaded tiers in a worker thread).

Why it matters (engines/step_thread.py): libgomp keeps a worker pool per thread that enters a parallel
region and stops its workers spinning between regions once it manages more threads than there are CPUs,
so every parallel region of a decode step then pays a wake-up. Placements alternate `--repeats` times
(this VM's speed drifts); medians are reported.

    python -m bench.step_thread [--model small] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import cpu_model, print_table, write_results

PLACEMENTS = ("step_thread", "loaded_elsewhere")
PROMPT_TOKENS = 64


async def stream_one(engine: Any, tokens: int) -> dict[str, float]:
    """TTFT and the median gap between tokens of one greedy request of `tokens` tokens."""
    from engines.sampling_params import SamplingParams

    prompt = [1000 + (37 * i) % 20000 for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    arrivals = [time.perf_counter() async for output in engine.generate("r", prompt, params) if output.new_token_ids]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    return {"ttft_ms": (arrivals[0] - started) * 1000, "decode_step_ms_p50": statistics.median(gaps)}


def child(placement: str, model: str, tokens: int) -> dict[str, float]:
    from engines.llm_engine import AsyncLLMEngine, LLMEngine
    from engines.tiers import tier_spec

    config = tier_spec(model, model).engine_config()
    engine = AsyncLLMEngine.build(config) if placement == "step_thread" else AsyncLLMEngine(LLMEngine(config))

    async def run() -> dict[str, float]:
        try:
            await stream_one(engine, 8)  # warm-up: first-call allocations, kernels built
            return await stream_one(engine, tokens)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=PLACEMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.tokens)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {placement: [] for placement in PLACEMENTS}
    for _ in range(args.repeats):
        for placement in PLACEMENTS:
            command = [sys.executable, "-m", "bench.step_thread", "--child", placement, "--model", args.model,
                       "--tokens", str(args.tokens)]  # fmt: skip
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[placement].append(json.loads(output.strip().splitlines()[-1]))
    medians = {
        placement: {key: statistics.median(run[key] for run in found) for key in found[0]}
        for placement, found in runs.items()
    }
    ratio = medians["loaded_elsewhere"]["decode_step_ms_p50"] / medians["step_thread"]["decode_step_ms_p50"]
    print_table(f"one request through AsyncLLMEngine ({args.model}, {cpu_model()}), median of {args.repeats}",
                ["placement", "TTFT ms", "decode step ms p50"],
                [[p, m["ttft_ms"], m["decode_step_ms_p50"]] for p, m in medians.items()])  # fmt: skip
    print(f"loaded elsewhere / step thread, decode step: {ratio:.2f}x")
    write_results("step_thread", {
        "model": args.model, "cpu": cpu_model(), "decode_tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS,
        "repeats": args.repeats, "placements": medians, "runs": runs,
        "decode_step_loaded_elsewhere_over_step_thread_x": ratio,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
