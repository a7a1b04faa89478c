"""Prefill time per tier — the time to first token of a request alone — against the tier's TTFT SLO.

`python -m bench.prefill [--models small large] [--prompt-tokens 200 600] [--repeats 3] [--threads N]
[--data DIR]`

Each demo model's engine is built from the spec `make run` serves it with (`engines.tiers.tier_spec`:
`quantization = "auto"`), prefix caching off so that no repeat profits from another. A prompt is GSM8K test
questions as one chat message, cut to exactly `--prompt-tokens` tokens; a request of it alone runs to its first
token (`max_tokens=1`). Configurations, alternated repeat by repeat so that the machine's drift weighs on each alike:

  shipped            the engine as `make run` builds it: on CPUs without int8 dot products (AVX2), int8
                     weight-only layers, every prompt token a decode row through the native layers (one C call
                     a layer for up to 48 rows, `ModelRunner.native_prefill`); elsewhere w8a8, prompts in
                     prefill chunks through the modules;
  prefill_chunks     the same engine with its prompts in prefill chunks through the modules (`int8_gemv`
                     products, SDPA attention): the path before 2026-12-07 (only where the shipped engine
                     prefills through the native layers);
  batch_invariant    the same engine with every prompt token attending as a decode row
                     (`EngineConfig.batch_invariant`: a request's bits whatever its batch, chunking or cache; only
                     where that differs from shipped: w8a8 on AMX or VNNI);
  float32            float32 weights throughout (another engine of the same checkpoint; `--no-float32`
                     skips it): what the time is without quantisation.

Reported per model and prompt length: the best and the median TTFT of `--repeats` runs, the ratio of the
previous path's median to the shipped one's, and whether the shipped median is within the tier's
`slo_ttft_p99_ms` (gateway/config.py). Writes bench/results/prefill.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, print_table, write_results
from bench.engine import GSM8K_DIR, engine_config
from engines.llm_engine import LLMEngine
from engines.sampling_params import SamplingParams
from engines.tiers import tier_spec
from gateway.config import default_tiers


def prompt_of(engine: LLMEngine, questions: list[str], tokens: int) -> list[int]:
    """GSM8K questions as one user message, repeated as needed, cut to exactly `tokens` token ids."""
    text = " ".join(questions)
    while True:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        if len(ids) >= tokens:
            return ids[:tokens]
        text = f"{text} {text}"


def time_to_first_token(engine: LLMEngine, prompt: list[int], request_id: str) -> float:
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


# Each configuration a bench run takes, by name: a context manager around the run.
Configurations = dict[str, Callable[[LLMEngine], AbstractContextManager[None]]]


def runner_flag(name: str, value: bool) -> Callable[[LLMEngine], AbstractContextManager[None]]:
    """A configuration: the engine's model runner with its flag `name` set to `value` for the run, then as it was."""

    @contextmanager
    def configured(engine: LLMEngine) -> Iterator[None]:
        before = getattr(engine.runner, name)
        setattr(engine.runner, name, value)
        try:
            yield
        finally:
            setattr(engine.runner, name, before)

    return configured


def configurations(engine: LLMEngine) -> Configurations:
    """The configurations that apply to this engine, each as a context manager around a run."""
    ways: Configurations = {"shipped": lambda _: nullcontext()}
    if engine.runner.native_prefill:  # prompts in prefill chunks through the modules, not as native decode rows
        ways["prefill_chunks"] = runner_flag("native_prefill", False)
    elif engine.runner.rows_are_batch_invariant():  # every prompt token a decode row (EngineConfig.batch_invariant)
        ways["batch_invariant"] = runner_flag("batch_invariant", True)
    return ways


def measure(engine: LLMEngine, ways: Configurations, prompts: dict[int, list[int]], repeats: int
            ) -> dict[int, dict[str, list[float]]]:  # fmt: skip
    times: dict[int, dict[str, list[float]]] = {n: {name: [] for name in ways} for n in prompts}
    time_to_first_token(engine, prompts[min(prompts)], "warm-up")
    for repeat in range(repeats):
        for n, prompt in prompts.items():
            for name in list(ways) if repeat % 2 == 0 else list(reversed(ways)):
                with ways[name](engine):
                    times[n][name].append(time_to_first_token(engine, prompt, f"{n}-{repeat}-{name}"))
    return times


def model_figures(model: str, args: argparse.Namespace, questions: list[str], slo_ms: float) -> dict[str, Any]:
    config = dataclasses.replace(engine_config(tier_spec(model, model), args), enable_prefix_caching=False)
    engine = LLMEngine(config)
    prompts = {n: prompt_of(engine, questions, n) for n in args.prompt_tokens}
    ways = configurations(engine)
    times = measure(engine, ways, prompts, args.repeats)
    figures: dict[str, Any] = {"precision": engine.precision(), "slo_ttft_p99_ms": slo_ms,
                               "previous_path_applies": "prefill_chunks" in ways,
                               "batch_invariant_applies": "batch_invariant" in ways, "prompts": {}}
    del engine
    gc.collect()
    float32_times: dict[int, list[float]] = {}
    if args.float32:
        reference = LLMEngine(dataclasses.replace(config, quantization=None))
        time_to_first_token(reference, prompts[min(prompts)], "warm-up")
        float32_times = {n: [time_to_first_token(reference, p, f"f{n}-{r}") for r in range(args.repeats)]
                         for n, p in prompts.items()}
        del reference
        gc.collect()
    for n in prompts:
        entry: dict[str, Any] = {}
        for name, values in [*times[n].items(), ("float32", float32_times.get(n, []))]:
            if values:
                entry[f"{name}_ttft_ms_median"] = 1000 * statistics.median(values)
                entry[f"{name}_ttft_ms_best"] = 1000 * min(values)
        if "prefill_chunks_ttft_ms_median" in entry:
            entry["speedup_vs_prefill_chunks"] = (entry["prefill_chunks_ttft_ms_median"]
                                                  / entry["shipped_ttft_ms_median"])
        if "batch_invariant_ttft_ms_median" in entry:
            entry["batch_invariant_vs_shipped"] = (entry["batch_invariant_ttft_ms_median"]
                                                   / entry["shipped_ttft_ms_median"])
        if "float32_ttft_ms_median" in entry:
            entry["speedup_vs_float32"] = entry["float32_ttft_ms_median"] / entry["shipped_ttft_ms_median"]
        entry["shipped_within_slo"] = entry["shipped_ttft_ms_median"] <= slo_ms
        entry["shipped_prompt_tokens_per_s"] = n / (entry["shipped_ttft_ms_median"] / 1000)
        figures["prompts"][str(n)] = entry
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "large"], help="demo tiers (engines/<name>/spec.py)")
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[200, 600])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: physical cores)")
    parser.add_argument("--no-float32", dest="float32", action="store_false", help="skip the float32 engine")
    parser.add_argument("--data", type=Path, default=GSM8K_DIR, help="directory of GSM8K's test.jsonl")
    args = parser.parse_args()
    test = args.data / "test.jsonl"
    if not test.is_file():
        raise SystemExit(f"{test} not found: the benchmark builds its prompts from GSM8K (see ../shared/data)")
    questions = [json.loads(line)["question"] for line in test.read_text().splitlines()[:40]]
    tiers = default_tiers()  # the shipped SLOs
    figures: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "models": {}}
    rows = []
    for model in args.models:
        slo_ms = tiers[model].slo_ttft_p99_ms if model in tiers else float("nan")
        result = model_figures(model, args, questions, slo_ms)
        figures["models"][model] = result
        for n, entry in result["prompts"].items():
            others = [entry.get(key, "–") for key in (
                "prefill_chunks_ttft_ms_median", "speedup_vs_prefill_chunks", "batch_invariant_ttft_ms_median",
                "batch_invariant_vs_shipped", "float32_ttft_ms_median")]
            rows.append([model, n, entry["shipped_ttft_ms_median"], *others, slo_ms,
                         "yes" if entry["shipped_within_slo"] else "NO"])
    print_table(f"Prefill: TTFT of a request alone, median of {args.repeats} (ms); CPU: {cpu_model()}",
                ["tier", "prompt tokens", "shipped", "prefill chunks (before)", "ratio", "batch-invariant",
                 "batch-invariant / shipped", "float32", "SLO p99", "within SLO"], rows)
    write_results("prefill", figures)


if __name__ == "__main__":
    main()
