"""Speculative decoding on the large tier (small tier's model as drafter) against plain decoding, same run.

`python -m bench.speculative [--target large] [--drafter small] [--prompts 4] [--output-tokens 96]`

Workload: GSM8K test questions (/work/shared/data/gsm8k) as chat prompts, greedy, `--output-tokens`
tokens each unless the model stops first. One engine holds both models (the tier's shipped
precision, `quantization=auto`; prefix caching off so that no run profits from another); each
configuration runs the same prompts at batch 1 (one after another) and batch 4 (together), the three
interleaved group by group so that the machine's drift during the run weighs on each alike:

  plain            the target alone, one token per sequence per step;
  speculative      as shipped: the drafter proposes tokens, the target verifies them in one forward; a round of
                   one sequence drafts while one more draft pays, judged by the drafter's probability for its own
                   tokens, a batch's round the k the running acceptance rate suggests (at most
                   `--num-speculative-tokens`; under the JSON's `speculative_*` keys);
  the other rule   whichever of the two rules the shipped one does not use at this batch size, for every round:
                   `alpha_rule_*` keys at batch 1 (the k the acceptance rate suggests), `adaptive_drafts_*` above
                   (drafting while one more draft pays).

Reported per batch size: decode tokens/s (output tokens after each request's first, over the time
after its first token; with the drafter that time includes its pass over the prompt, which it makes at
the first round, not while the target prefills) and its ratio to plain decoding, pooled and as the
median of per-group paired ratios, end-to-end tokens/s, the drafter's acceptance rate, mean tokens per
target forward, and whether the greedy outputs are token-identical. Writes bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import print_table, run_without_amx, write_results
from bench.engine import GSM8K_DIR
from engines.large.spec import SPEC as LARGE
from engines.llm_engine import LLMEngine
from engines.sampling_params import SamplingParams
from engines.speculative import CONFIDENCE_BINS, SpeculativeStats, Speculator

GSM8K_TEST = GSM8K_DIR / "test.jsonl"
INSTRUCTION = "Solve this math problem step by step, then give the final answer after '####'."


def gsm8k_prompts(engine: LLMEngine, path: Path, count: int) -> list[list[int]]:
    if not path.is_file():
        raise SystemExit(f"{path} not found: the benchmark needs the GSM8K test questions (see /work/shared/data)")
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:count]]
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": f"{INSTRUCTION}\n\n{q}"}])
            for q in questions]


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, output_tokens: int) -> dict[str, Any]:
    """Generate every prompt, `batch` at a time; return outputs and timings."""
    params = SamplingParams(temperature=0, max_tokens=output_tokens)
    outputs: dict[str, list[int]] = {}
    decode_tokens, decode_seconds, total_tokens = 0, 0.0, 0
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = {f"p{i}": prompts[i] for i in range(first, min(first + batch, len(prompts)))}
        first_token_at: dict[str, float] = {}
        for request_id, prompt in group.items():
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                now = time.perf_counter()
                outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
                first_token_at.setdefault(output.request_id, now)
                if output.finished:
                    decode_tokens += len(outputs[output.request_id]) - 1
                    decode_seconds += now - first_token_at[output.request_id]
        total_tokens += sum(len(outputs[request_id]) for request_id in group)
    elapsed = time.perf_counter() - started
    return {
        "outputs": [outputs[f"p{i}"] for i in range(len(prompts))],
        # Per-request decode rates averaged by time: sum of tokens over sum of each request's decode time,
        # times the batch (requests of a group decode concurrently).
        "decode_tokens_per_s": decode_tokens / decode_seconds * batch,
        "end_to_end_tokens_per_s": total_tokens / elapsed,
        "seconds": elapsed,
        "decode_tokens": decode_tokens, "decode_seconds": decode_seconds, "total_tokens": total_tokens,
    }


RULES = {"alpha_rule": False, "adaptive_drafts": True}  # the rules a configuration can force on every round


def other_rule(speculator: Speculator, batch: int) -> str:
    """The rule that the shipped one does not use for rounds of `batch` sequences."""
    return "alpha_rule" if speculator.adapts(batch) else "adaptive_drafts"


def run_interleaved(engine: LLMEngine, speculator: Speculator, prompts: list[list[int]], batch: int,
                    output_tokens: int) -> tuple[dict[str, dict[str, Any]], dict[str, SpeculativeStats]]:
    """Each group of `batch` prompts under every configuration in turn (plain, speculative as shipped, the other
    rule), the order rotating from group to group, so that a drift of this machine's speed during the run weighs on
    all three alike instead of on whichever ran last."""
    shipped, other = speculator.adaptive_drafts, other_rule(speculator, batch)
    configurations = ("plain", "speculative", other)
    stats = {"speculative": SpeculativeStats(), other: SpeculativeStats()}
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in configurations}
    for index, first in enumerate(range(0, len(prompts), batch)):
        shift = index % len(configurations)
        for name in configurations[shift:] + configurations[:shift]:
            engine.speculator = None if name == "plain" else speculator
            if name != "plain":
                speculator.adaptive_drafts, speculator.stats = RULES.get(name, shipped), stats[name]
            parts[name].append(run(engine, prompts[first:first + batch], batch, output_tokens))
    engine.speculator, speculator.adaptive_drafts = speculator, shipped
    merged = {}
    for name, runs in parts.items():
        decode_seconds = sum(part["decode_seconds"] for part in runs)
        merged[name] = {
            "outputs": [output for part in runs for output in part["outputs"]],
            "decode_tokens_per_s": sum(part["decode_tokens"] for part in runs) / decode_seconds * batch,
            "end_to_end_tokens_per_s": sum(part["total_tokens"] for part in runs) / sum(part["seconds"]
                                                                                          for part in runs),
            # Against plain decoding on the same group, run minutes apart: the median of these paired ratios
            # is what a drift of the machine's speed moves least.
            "paired_ratios": [part["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                              for part, plain in zip(runs, parts["plain"], strict=True)],
        }
    return merged, stats


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="large")
    parser.add_argument("--drafter", default="small")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data", type=Path, default=GSM8K_TEST)
    parser.add_argument("--quantization", default=None,
                        help="the large tier's weights (default: its shipped `auto`), e.g. int8 or w8a8")
    parser.add_argument("--without-amx", action="store_true",
                        help="build w8a8 layers and attention as on a CPU without AMX (VNNI, vdpbf16ps), on a CPU "
                             "that has it")
    args = parser.parse_args()
    if args.without_amx:
        run_without_amx()

    load_started = time.perf_counter()
    # The large tier's shipped settings (precision, KV cache), with the drafter named here.
    spec = LARGE.replace(model=args.target, speculative_draft=args.drafter, kv_cache_mb=256,
                         num_speculative_tokens=args.num_speculative_tokens, num_threads=args.threads,
                         **({"quantization": args.quantization} if args.quantization else {}))
    engine = LLMEngine(dataclasses.replace(spec.engine_config(), enable_prefix_caching=False))
    print(f"loaded {args.target} + drafter {args.drafter} in {time.perf_counter() - load_started:.0f}s, "
          f"peak RSS {rss_gb():.1f} GB, precision {engine.precision()}")
    speculator = engine.speculator
    assert speculator is not None
    prompts = gsm8k_prompts(engine, args.data, args.prompts)
    run(engine, prompts[:1], 1, 8)  # warm-up: first-call allocations, oneDNN/packing caches

    results: dict[str, Any] = {}
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        measured, stats = run_interleaved(engine, speculator, prompts, batch, args.output_tokens)
        plain = measured["plain"]
        figures = {"plain_decode_tokens_per_s": plain["decode_tokens_per_s"],
                   "plain_end_to_end_tokens_per_s": plain["end_to_end_tokens_per_s"],
                   "plain_ms_per_step": 1000 * batch / plain["decode_tokens_per_s"]}
        # The shipped rule under the historic keys (speculative_*, acceptance_rate, ...), the other one beside it.
        other = other_rule(speculator, batch)
        figures |= configuration_figures(measured["speculative"], stats["speculative"], plain, batch, "")
        figures |= configuration_figures(measured[other], stats[other], plain, batch, f"{other}_")
        # Does the drafter's probability for its own token predict acceptance (what adaptive rounds rely on)?
        adaptive = stats["speculative" if other == "alpha_rule" else other]
        figures["adaptive_drafts_acceptance_by_drafter_probability"] = [
            {"drafter_probability_from": edge, "judged": judged, "accepted": accepted,
             "acceptance_rate": accepted / judged if judged else None}
            for edge, judged, accepted in zip(CONFIDENCE_BINS, adaptive.judged_by_confidence,
                                              adaptive.accepted_by_confidence, strict=True)]
        results[f"batch_{batch}"] = figures
        print(f"batch {batch}: plain {plain['decode_tokens_per_s']:.2f} tok/s, speculative "
              f"{figures['speculative_decode_tokens_per_s']:.2f} tok/s, acceptance {figures['acceptance_rate']:.0%}",
              flush=True)
        rows.append([batch, plain["decode_tokens_per_s"], figures["speculative_decode_tokens_per_s"],
                     f"{figures['speculative_over_plain_decode']:.2f}x",
                     f"{figures['median_paired_speculative_over_plain_decode']:.2f}x",
                     f"{figures['acceptance_rate']:.0%}", figures["mean_drafts_per_round"],
                     figures["tokens_per_target_forward"], figures["greedy_outputs_identical"], other,
                     f"{figures[f'{other}_speculative_over_plain_decode']:.2f}x",
                     f"{figures[f'{other}_median_paired_speculative_over_plain_decode']:.2f}x"])
    print_table(f"Speculative decoding: {args.target} with drafter {args.drafter}, GSM8K prompts, greedy, "
                f"{args.output_tokens} tokens",
                ["batch", "plain tok/s", "speculative tok/s", "ratio", "median paired ratio", "acceptance",
                 "drafts/round", "tokens/target fwd", "identical", "other rule", "its ratio", "median paired"], rows)
    write_results("speculative", {
        "cpu": _cpu_model(), "load_average_at_end": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "target": args.target, "drafter": args.drafter, "precision": engine.precision(),
        "w8a8_without_amx": args.without_amx, "prompts": args.prompts, "output_tokens": args.output_tokens,
        "max_num_speculative_tokens": args.num_speculative_tokens, "peak_rss_gb": rss_gb(), **results,
    })


def configuration_figures(measured: dict[str, Any], stats: SpeculativeStats, plain: dict[str, Any], batch: int,
                          prefix: str) -> dict[str, Any]:
    identical = sum(a == b for a, b in zip(plain["outputs"], measured["outputs"], strict=True))
    figures = {
        "speculative_decode_tokens_per_s": measured["decode_tokens_per_s"],
        "speculative_over_plain_decode": measured["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
        "median_paired_speculative_over_plain_decode": statistics.median(measured["paired_ratios"]),
        "speculative_end_to_end_tokens_per_s": measured["end_to_end_tokens_per_s"],
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_target_forward": stats.num_emitted_tokens / max(stats.num_rounds * batch, 1),
        "mean_drafts_per_round": stats.num_draft_tokens / max(stats.num_rounds * batch, 1),
        # Where a round's time goes: k drafter forwards, then one target forward over k + 1 rows a sequence.
        "draft_ms_per_round": 1000 * stats.draft_seconds / max(stats.num_rounds, 1),
        "verify_ms_per_round": 1000 * stats.verify_seconds / max(stats.num_rounds, 1),
        "greedy_outputs_identical": f"{identical}/{len(plain['outputs'])}",
        "first_divergence": first_divergences(plain["outputs"], measured["outputs"]),
    }
    return {prefix + key: value for key, value in figures.items()}


def first_divergences(plain: list[list[int]], speculative: list[list[int]]) -> list[int | None]:
    """Per prompt: the index of the first differing token (None when identical)."""
    found: list[int | None] = []
    for a, b in zip(plain, speculative, strict=True):
        index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        found.append(index if index is not None or len(a) == len(b) else min(len(a), len(b)))
    return found


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
