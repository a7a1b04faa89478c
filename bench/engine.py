"""Our engine against HF transformers `generate` on one loaded serving workload.

`python -m bench.engine [--model small] [--requests 64] [--quick]`

Workload: requests arrive as a Poisson process (`--rate`, 1/s by default: enough to keep the engine loaded
on AVX2 and VNNI CPUs; with AMX it serves them as fast as they arrive, so raise `--rate` there to compare
speeds; BENCHMARKS.md); prompts of 50–800 tokens are cut from real text (GSM8K questions,
/work/shared/data/gsm8k); 30% of them start with the same 500-token system prompt; every request
generates exactly `--output-tokens` tokens (greedy, EOS ignored). Both systems load the same weights from
the same checkpoint and see the same prompts and arrival times:

  (i)  our AsyncLLMEngine (continuous batching, paged KV cache, prefix caching) in the configuration
       `make run` serves: the tier spec of `--model` (`engines.tiers.tier_spec`: `engines/small/spec.py`
       for small, `engines/large/spec.py` for large, the `TierSpec` defaults for any other model), so
       dtype, quantization, kv_cache_dtype, kv_cache_mb, max_num_seqs, max_num_batched_tokens and
       max_model_len (and a speculative drafter, if the spec names one) all come from the spec; the
       only override is the thread count (`--threads`, the same for both systems). The engine flags
       (`--dtype`, `--quantization`, ...) override single spec fields for experiments, and are
       unset by default;
  (ii) HF transformers `generate` in static batches in arrival order (SDPA attention, left padding,
       `torch.inference_mode`), each batch starting once its last request has arrived. A short probe
       in the same run times every candidate setting (float32 or bfloat16 weights, dynamic or static
       KV cache; `--hf-setting` fixes one) at every batch size of 8, 16 and 32 that the workload fills
       (`--hf-batch-size` fixes one): one `generate` of as many 64-token prompts with 8 new tokens,
       scored by output tokens/s (prompt tokens to decode steps 8:1; the workload's, padding
       included, is about 6:1). The fastest (setting, batch size) runs the workload.

Two ratios of output tokens/s, measured side by side in the same run:
  full-stack:     (i) at its shipped precision against (ii) at its fastest setting and batch size;
  same-precision: (i) again with float32 weights, activations and KV cache (no quantisation; as many KV
                  blocks as the shipped run had, so only the precision differs) against (ii) in float32
                  at its fastest float32 cache and batch size (a second HF run only when bfloat16 won
                  the probe). `--no-same-precision` skips it.
Both run with the same torch intra-op thread count (`--threads`), and all PyTorch work of both (loading,
HF generate, every engine step) runs on the engine's step thread, as it does in the gateway
(`engines.step_thread`: libgomp slows every thread's parallel regions once two threads hold worker pools).

Batch-1 decode (`--batch1-only` runs just that): one greedy request alone after the workload, its
decode tokens/s as bytes of weights read per second (`decode_weight_bytes`) over the memory bandwidth a
large tensor read or copy reaches in the same run, just before and after (the roofline).

Reported: output tokens/s, TTFT and ITL p50/p99, KV waste (token slots allocated in held blocks
but not holding a token, averaged over the run), prefix-cache hit rate, and separately the TTFT of
a request whose 500-token system prompt is cached against the same request uncached, and what our
precision settings cost in quality: perplexity of 2048 held-out tokens and top-1 agreement with
float32 weights, activations and KV cache (same checkpoint, teacher-forced through our model code),
and on the path that generates: greedy answers to 16 GSM8K test questions against the engine in float32
(token agreement, final-answer agreement and accuracy; `bench.quant_quality` does this for every format).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, mean, percentile, print_table, run_without_amx, write_results
from engines.config import EngineConfig, ModelConfig
from engines.loader import Checkpoint, load_checkpoint
from engines.registry import resolve_model
from engines.sampling_params import SamplingParams
from engines.step_thread import STEP_THREAD
from engines.tiers import DEMO_TIERS, TierSpec, tier_spec

GSM8K_DIR = Path("/work/shared/data/gsm8k")
SYSTEM_PROMPT_TOKENS = 500
SHARED_PREFIX_FRACTION = 0.3
HF_BATCH_SIZES = (8, 16, 32)  # HF's candidate batch sizes, probed like its cache setting
CACHED_PREFIX_TRIALS = 3
CACHED_PREFIX_QUESTION_TOKENS = 24


# -- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    arrivals: list[float]  # seconds after the start
    shares_system_prompt: list[bool]
    output_tokens: int
    rate_per_s: float


def _corpus_texts() -> tuple[list[str], list[str], str]:
    """(questions for user turns, questions for system prompts, where they came from)."""
    test, train = GSM8K_DIR / "test.jsonl", GSM8K_DIR / "train.jsonl"
    if test.is_file() and train.is_file():

        def questions(path: Path) -> list[str]:
            return [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]

        return questions(test), questions(train), "gsm8k questions"
    print(f"note: {GSM8K_DIR} not found; falling back to synthetic arithmetic text")
    rng = random.Random(1)
    synthetic = [
        f"A shop sells {rng.randint(2, 90)} apples on day {d} and {rng.randint(2, 90)} pears; "
        f"each costs {rng.randint(1, 9)} dollars. How much money does it make in {rng.randint(2, 9)} days?"
        for d in range(4000)
    ]
    return synthetic[:2000], synthetic[2000:], "synthetic arithmetic text"


def gsm8k_worked_answers(directory: Path, start: int, count: int) -> list[str]:
    """GSM8K train questions `start` to `start + count`, each followed by its worked answer."""
    with (directory / "train.jsonl").open() as f:
        lines = itertools.islice(f, start, start + count)
        return [f"{raw['question']}\n{raw['answer']}" for raw in map(json.loads, lines)]


def token_stream(tokenizer: Any, texts: Sequence[str], min_tokens: int) -> list[int]:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text + "\n"))
        if len(ids) >= min_tokens:
            break
    return ids


def build_workload(
    tokenizer: Any, num_requests: int, output_tokens: int, rate_per_s: float, max_prompt: int, seed: int
) -> tuple[Workload, str, list[int]]:
    """The workload, its text source, and a token stream unused by it (for fresh system prompts)."""
    user_texts, system_texts, source = _corpus_texts()
    user_tokens = token_stream(tokenizer, user_texts, 60_000)
    system_tokens = token_stream(tokenizer, system_texts, SYSTEM_PROMPT_TOKENS * (CACHED_PREFIX_TRIALS + 2))
    system_prompt = system_tokens[:SYSTEM_PROMPT_TOKENS]
    rng = random.Random(seed)
    prompts, shares, arrivals, clock = [], [], [], 0.0
    for _ in range(num_requests):
        length = rng.randint(50, max_prompt)
        shared = rng.random() < SHARED_PREFIX_FRACTION
        body_length = max(50, length - SYSTEM_PROMPT_TOKENS) if shared else length
        start = rng.randrange(0, len(user_tokens) - body_length)
        body = user_tokens[start : start + body_length]
        prompts.append(system_prompt + body if shared else body)
        shares.append(shared)
        clock += rng.expovariate(rate_per_s)
        arrivals.append(clock)
    workload = Workload(prompts, arrivals, shares, output_tokens, rate_per_s)
    return workload, source, system_tokens[SYSTEM_PROMPT_TOKENS:]


# -- measurements --------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    arrival: float  # absolute perf_counter time
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def summarise(timings: Sequence[RequestTiming], started: float) -> dict[str, float]:
    ended = max(t.token_times[-1] for t in timings)
    output_tokens = sum(len(t.token_times) for t in timings)
    ttfts = [t.ttft for t in timings]
    itls = [gap for t in timings for gap in t.itls]
    return {
        "output_tokens": output_tokens,
        "wall_s": ended - started,
        "output_tokens_per_s": output_tokens / (ended - started),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": mean(ttfts),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
    }


# -- (i) our engine ------------------------------------------------------------------------------


@dataclass
class KVWasteSampler:
    """Samples held KV blocks and their empty token slots while the engine runs."""

    allocated_slots: int = 0
    empty_slots: int = 0
    blocks_used: list[int] = field(default_factory=list)

    def sample(self, llm_engine: Any) -> None:
        block_size = llm_engine.config.block_size
        # Read from outside the step thread: a sample may be a step stale, which averages out.
        running = list(llm_engine.scheduler.running)
        held_blocks = llm_engine.block_manager.num_blocks - llm_engine.block_manager.num_free_blocks
        if not held_blocks:
            return
        # Only full blocks are shared between sequences, so empty slots are in each sequence's last block.
        empty = sum(max(0, len(seq.block_table) * block_size - seq.num_tokens) for seq in running)
        self.allocated_slots += held_blocks * block_size
        self.empty_slots += empty
        self.blocks_used.append(held_blocks)

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.empty_slots / self.allocated_slots if self.allocated_slots else float("nan")


async def run_engine(async_engine: Any, workload: Workload) -> tuple[list[RequestTiming], float, KVWasteSampler]:
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
    sampler = KVWasteSampler()
    started = time.perf_counter()

    async def one(index: int) -> RequestTiming:
        timing = RequestTiming(arrival=started + workload.arrivals[index])
        await asyncio.sleep(max(0.0, timing.arrival - time.perf_counter()))
        async for output in async_engine.generate(f"bench-{index}", workload.prompts[index], params):
            timing.token_times.extend([time.perf_counter()] * len(output.new_token_ids))
        return timing

    async def sample_kv(done: asyncio.Event) -> None:
        while not done.is_set():
            sampler.sample(async_engine.engine)
            await asyncio.sleep(0.1)

    done = asyncio.Event()
    sampling = asyncio.create_task(sample_kv(done))
    timings = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    done.set()
    await sampling
    return list(timings), started, sampler


async def first_token_seconds(async_engine: Any, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    async for output in async_engine.generate(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1)):
        if output.new_token_ids:
            return time.perf_counter() - started
    raise RuntimeError("the engine produced no token")


async def cached_prefix_ttft(
    async_engine: Any, fresh_tokens: list[int], question_tokens: list[int]
) -> tuple[float, float]:
    """Median TTFT of (system prompt + question) when the system prompt is new vs already cached."""
    uncached, cached = [], []
    for trial in range(CACHED_PREFIX_TRIALS):
        system = fresh_tokens[trial * SYSTEM_PROMPT_TOKENS : (trial + 1) * SYSTEM_PROMPT_TOKENS]
        q = CACHED_PREFIX_QUESTION_TOKENS
        first_question = question_tokens[2 * trial * q : (2 * trial + 1) * q]
        second_question = question_tokens[(2 * trial + 1) * q : (2 * trial + 2) * q]
        uncached.append(await first_token_seconds(async_engine, f"uncached-{trial}", system + first_question))
        cached.append(await first_token_seconds(async_engine, f"cached-{trial}", system + second_question))
    return statistics.median(uncached), statistics.median(cached)


ENGINE_FLAGS = ("dtype", "quantization", "w8a8_attention_passes", "kv_cache_dtype", "kv_cache_mb", "max_num_seqs",
                "max_num_batched_tokens", "speculative_draft")


def shipped_spec(args: argparse.Namespace) -> TierSpec:
    """The spec `make run` serves `--model` with (`tier_spec`, as the gateway builds it: the demo tier's
    `engines/<model>/spec.py`, else the `TierSpec` defaults), with the engine flags that are set over it."""
    return tier_spec(args.model, args.model, **{flag: getattr(args, flag) for flag in ENGINE_FLAGS})


def engine_config(spec: TierSpec, args: argparse.Namespace) -> EngineConfig:
    """The spec's engine configuration; the bench overrides only the thread count (both systems share it)."""
    return dataclasses.replace(spec.engine_config(), num_threads=args.threads)


def same_precision_config(config: EngineConfig, num_kv_blocks: int) -> EngineConfig:
    """`config` in float32 throughout (weights, activations, KV cache; no quantisation), with as many KV
    blocks (tokens of cache) as the shipped run had, so that only the precision differs."""
    return dataclasses.replace(config, dtype="float32", quantization=None, kv_cache_dtype="float32",
                               num_kv_blocks=num_kv_blocks)  # fmt: skip


async def bench_engine(
    checkpoint: Checkpoint, config: EngineConfig, workload: Workload, fresh_tokens: list[int],
    batch1_tokens: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The workload through our engine in `config`; then, unless `batch1_tokens` is None, the cached-prefix
    TTFT and batch-1 decode too."""
    from engines.llm_engine import AsyncLLMEngine, LLMEngine

    llm_engine = STEP_THREAD.call(functools.partial(LLMEngine.from_checkpoint, checkpoint, config))
    precision = llm_engine.precision()
    async_engine = AsyncLLMEngine(llm_engine)
    prefix: dict[str, float] | None = None
    try:
        # Warm-up outside the measurement (first-call allocations, thread pools).
        await first_token_seconds(async_engine, "warmup", workload.prompts[0][:32])
        before = async_engine.stats()
        timings, started, sampler = await run_engine(async_engine, workload)
        await asyncio.sleep(0.05)
        after = async_engine.stats()
        queries = after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens
        hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        if batch1_tokens is not None:
            question_tokens = [t for p in workload.prompts for t in p[-CACHED_PREFIX_QUESTION_TOKENS:]]
            uncached, cached = await cached_prefix_ttft(async_engine, fresh_tokens, question_tokens)
            prefix = {"uncached_s": uncached, "cached_s": cached}
    finally:
        await async_engine.shutdown()
    batch1 = None
    if batch1_tokens is not None:
        prompt = workload.prompts[0][:BATCH1_PROMPT_TOKENS]
        batch1 = STEP_THREAD.call(functools.partial(batch1_decode, llm_engine, prompt, batch1_tokens))
    figures = summarise(timings, started)
    figures.update(
        kv_blocks_total=after.kv_blocks_total,
        kv_blocks_used_mean=mean(sampler.blocks_used),
        kv_blocks_used_max=max(sampler.blocks_used, default=0),
        kv_waste_pct=sampler.waste_pct,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        preemptions=after.num_preempted_total - before.num_preempted_total,
    )
    return {"figures": figures, "cached_prefix_ttft": prefix, "batch1": batch1, "precision": precision}


# -- batch-1 decode against the memory roofline ---------------------------------------------------

BANDWIDTH_BYTES = 512 << 20  # far beyond the last-level cache
BANDWIDTH_TRIALS = 5
DECODE_WARMUP_STEPS = 4
BATCH1_PROMPT_TOKENS = 64


def memory_bandwidth() -> dict[str, float]:
    """Bytes/s a large float32 tensor reaches here, read (`sum`) and copied (read + write), with the
    torch threads the engine uses: best of a few trials. The higher is the roofline of a decode step,
    which streams its weights once."""
    source = torch.ones(BANDWIDTH_BYTES // 4)
    target = torch.empty_like(source)

    def best(operation: Any) -> float:
        operation()  # first touch
        seconds = []
        for _ in range(BANDWIDTH_TRIALS):
            started = time.perf_counter()
            operation()
            seconds.append(time.perf_counter() - started)
        return min(seconds)

    read = BANDWIDTH_BYTES / best(source.sum)
    copy = 2 * BANDWIDTH_BYTES / best(lambda: target.copy_(source))
    return {"read_gb_s": read / 1e9, "copy_gb_s": copy / 1e9, "roofline_gb_s": max(read, copy) / 1e9}


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer (shared tensors once) except an
    embedding table the head does not share, of which a step reads one row."""
    from engines.quantization import tensor_key
    from engines.speculative import weight_bytes

    embedding, head = model.embed_tokens, model.lm_head
    shared = {tensor_key(t) for t in [*embedding.parameters(), *embedding.buffers()]} & (
        {tensor_key(t) for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    )
    return weight_bytes(model) - (0 if shared else weight_bytes(embedding))


def batch1_decode(llm_engine: Any, prompt: list[int], tokens: int) -> dict[str, float]:
    """One greedy request alone: decode tokens/s through `LLMEngine.step` (scheduling, sampling and
    detokenisation included, as a user meets them), as weight bytes/s over the bandwidth measured
    just before and after."""
    from engines.sampling_params import SamplingParams

    before = memory_bandwidth()
    llm_engine.add_request("batch1", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    for _ in range(1 + DECODE_WARMUP_STEPS):  # the prefill, then a few decode steps
        llm_engine.step()
    decoded = 0  # tokens, not steps: a speculative round emits several
    started = time.perf_counter()
    while llm_engine.has_unfinished_requests():
        decoded += sum(len(output.new_token_ids) for output in llm_engine.step())
    seconds = time.perf_counter() - started
    after = memory_bandwidth()
    roofline = (before["roofline_gb_s"] + after["roofline_gb_s"]) / 2
    weight_gb = decode_weight_bytes(llm_engine.model) / 1e9
    tokens_per_s = decoded / seconds
    return {
        "decode_tokens_per_s": tokens_per_s,
        "step_ms": 1000 / tokens_per_s,
        "weight_gb_per_token": weight_gb,
        "weight_gb_per_s": weight_gb * tokens_per_s,
        "bandwidth_read_gb_s": (before["read_gb_s"] + after["read_gb_s"]) / 2,
        "bandwidth_copy_gb_s": (before["copy_gb_s"] + after["copy_gb_s"]) / 2,
        "roofline_gb_s": roofline,
        "roofline_fraction_pct": 100 * weight_gb * tokens_per_s / roofline,
        "roofline_tokens_per_s": roofline / weight_gb,
    }


@contextmanager
def pytorch_paths(llm_engine: Any) -> Iterator[None]:
    """The engine without its CPU decode kernels (`engines.cpu_kernels`): the PyTorch ops they replace. Layers
    in tile order (`TiledW8A8Linear`) keep theirs: their weight exists only in that order (`tiled_products`)."""
    from engines.quantization import Int8Linear

    # Int8Linear holds the GEMV kernel its mode runs (or None).
    layers = [(layer, layer.gemv) for layer in llm_engine.model.modules() if isinstance(layer, Int8Linear)]
    runner = llm_engine.runner
    attention, native = runner.decode_attention, runner.native_decoder
    for layer, _ in layers:
        layer.gemv = None
    runner.decode_attention = runner.native_decoder = None
    try:
        yield
    finally:
        for layer, gemv in layers:
            layer.gemv = gemv
        runner.decode_attention, runner.native_decoder = attention, native


def tiled_products(llm_engine: Any) -> bool:
    from engines.quantization import TiledW8A8Linear

    return any(isinstance(layer, TiledW8A8Linear) for layer in llm_engine.model.modules())


def run_batch1_only(checkpoint: Checkpoint, args: argparse.Namespace, model_path: Path, workload: Workload) -> None:
    """Batch-1 decode as shipped and on the PyTorch paths, alternated `--batch1-repeats` times (this VM's
    memory bandwidth drifts by tens of percent within minutes); the median run of each is reported."""
    from engines.cpu_kernels import int8_gemv
    from engines.llm_engine import LLMEngine

    llm_engine = LLMEngine.from_checkpoint(checkpoint, engine_config(shipped_spec(args), args))
    prompt = workload.prompts[0][:BATCH1_PROMPT_TOKENS]
    runs: dict[str, list[dict[str, float]]] = {"shipped": [], "pytorch_paths": []}
    for _ in range(args.batch1_repeats):
        runs["shipped"].append(batch1_decode(llm_engine, prompt, args.batch1_tokens))
        if int8_gemv() is not None:  # the kernels' library loaded on this machine
            with pytorch_paths(llm_engine):
                runs["pytorch_paths"].append(batch1_decode(llm_engine, prompt, args.batch1_tokens))
    median = {name: sorted(found, key=lambda run: run["decode_tokens_per_s"])[len(found) // 2]
              for name, found in runs.items() if found}  # fmt: skip
    figures = median["shipped"]
    print_batch1(f"{args.model}, median of {args.batch1_repeats}", figures)
    comparison = {}
    if "pytorch_paths" in median:
        keep_tiled = tiled_products(llm_engine)
        kept = " (products still on the tiled w8a8 kernel)" if keep_tiled else ""
        print_batch1(f"{args.model} without the CPU decode kernels (PyTorch ops{kept}), median of "
                     f"{args.batch1_repeats}", median["pytorch_paths"])  # fmt: skip
        comparison = {
            "pytorch_paths_keep_tiled_products": keep_tiled,
            "batch1_decode_pytorch_paths": median["pytorch_paths"],
            "kernels_over_pytorch_paths_x": figures["decode_tokens_per_s"]
            / median["pytorch_paths"]["decode_tokens_per_s"],
            "runs_tokens_per_s": {name: [run["decode_tokens_per_s"] for run in found] for name, found in runs.items()},
            "runs_roofline_fraction_pct": {
                name: [run["roofline_fraction_pct"] for run in found] for name, found in runs.items()
            },
        }
        print(f"kernels / PyTorch paths: {comparison['kernels_over_pytorch_paths_x']:.2f}x; runs (tok/s): "
              f"{comparison['runs_tokens_per_s']}")  # fmt: skip
    write_results(
        "engine_batch1",
        {
            "model": args.model,
            "model_path": str(model_path),
            "cpu": cpu_model(),
            "precision": llm_engine.precision(),
            "w8a8_without_amx": args.without_amx,
            "threads": args.threads,
            "decode_tokens": args.batch1_tokens,
            "prompt_tokens": BATCH1_PROMPT_TOKENS,
            "repeats": args.batch1_repeats,
            "batch1_decode": figures,
            "target_at_least_60_pct_of_roofline": figures["roofline_fraction_pct"] >= 60,
            **comparison,
        },
    )


def print_batch1(model: str, figures: dict[str, float]) -> None:
    print_table(
        f"Batch-1 decode against the memory roofline: {model} ({torch.get_num_threads()} threads)",
        ["tok/s", "step ms", "weights GB/token", "weights GB/s", "bandwidth GB/s (read, copy)", "% of roofline"],
        [[figures["decode_tokens_per_s"], figures["step_ms"], figures["weight_gb_per_token"],
          figures["weight_gb_per_s"], f"{figures['bandwidth_read_gb_s']:.1f}, {figures['bandwidth_copy_gb_s']:.1f}",
          figures["roofline_fraction_pct"]]],
    )  # fmt: skip


# -- quality: what our precision settings cost ----------------------------------------------------

QUALITY_TOKENS = 2048
QUALITY_CHUNK_TOKENS = 512


@torch.inference_mode()
def teacher_forced(llm_engine: Any, token_ids: list[int]) -> tuple[float, torch.Tensor]:
    """Mean negative log-likelihood per token of `token_ids` under the engine's model, and the argmax
    at each position: chunks prefilled through the engine's model runner (its layers, quantisation, KV-cache
    dtype and prefill attention, as a request's prompt is). The engine must be otherwise unused (its first cache
    blocks are overwritten)."""
    from engines.model_runner import TokenSpan

    runner = llm_engine.runner
    total, count, argmaxes = 0.0, 0, []
    for start in range(0, len(token_ids) - 1, QUALITY_CHUNK_TOKENS):
        chunk = token_ids[start : start + QUALITY_CHUNK_TOKENS + 1]
        blocks = list(range(-(-len(chunk) // runner.block_size)))
        logits = runner.forward([TokenSpan(chunk, 0, blocks, "all")])[:-1]
        targets = torch.tensor(chunk[1:])
        total -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
        count += len(chunk) - 1
        argmaxes.append(logits.argmax(dim=-1))
    return total / count, torch.cat(argmaxes)


def quality_vs_float32(checkpoint: Checkpoint, config: EngineConfig, token_ids: list[int]) -> dict[str, float]:
    """Perplexity of held-out text and top-1 agreement: our settings against float32 weights,
    activations and KV cache (no quantisation), same checkpoint."""
    from engines.llm_engine import LLMEngine

    small_cache = {"kv_cache_bytes": 64 << 20, "num_kv_blocks": None}
    reference = dataclasses.replace(config, dtype="float32", quantization=None, kv_cache_dtype=None, **small_cache)
    measured = {}
    for name, settings in (("float32", reference), ("ours", dataclasses.replace(config, **small_cache))):
        llm_engine = LLMEngine.from_checkpoint(checkpoint, settings)
        measured[name] = teacher_forced(llm_engine, token_ids)
        del llm_engine
    (reference_nll, reference_top), (nll, top) = measured["float32"], measured["ours"]
    return {
        "tokens": len(token_ids),
        "perplexity_float32": math.exp(reference_nll),
        "perplexity_ours": math.exp(nll),
        "perplexity_increase_pct": (math.exp(nll - reference_nll) - 1) * 100,
        "top1_agreement_with_float32_pct": (top == reference_top).float().mean().item() * 100,
    }


DECODE_QUALITY_QUESTIONS = 16  # GSM8K test questions answered greedily through the decode path
DECODE_QUALITY_TOKENS = 256  # bench.quant_quality's --max-tokens default: the figures compare


def decode_quality_vs_float32(checkpoint: Checkpoint, config: EngineConfig) -> dict[str, Any] | None:
    """Quality on the path that generates: greedy answers to GSM8K test questions with our settings against
    the same engine in float32 (token agreement, final-answer agreement, accuracy of both), as
    `bench.quant_quality` measures every format. The teacher-forced check above runs prefill-shaped
    inputs, which take other kernels than decode steps on some CPUs. None without the GSM8K data."""
    from bench.quant_quality import generation_agreement
    from bench.speculative import gsm8k_prompts
    from engines.llm_engine import context_length
    from router.label import load_gsm8k

    if not (GSM8K_DIR / "test.jsonl").is_file():
        print(f"decode-path quality skipped: {GSM8K_DIR}/test.jsonl not found (see ../shared/data/README.md)")
        return None
    questions = load_gsm8k(GSM8K_DIR, "test", DECODE_QUALITY_QUESTIONS)
    prompts = gsm8k_prompts(checkpoint, GSM8K_DIR / "test.jsonl", DECODE_QUALITY_QUESTIONS)  # needs `.tokenizer`
    # Answers as long as the model's context allows beside the longest prompt (a small test model's is short).
    context = context_length(config, checkpoint.config)
    max_tokens = min(DECODE_QUALITY_TOKENS, context - max(map(len, prompts)))
    if max_tokens < 1:
        print(f"decode-path quality skipped: the GSM8K prompts do not fit this model's {context}-token context")
        return None
    small_cache = dataclasses.replace(config, kv_cache_bytes=256 << 20, num_kv_blocks=None)
    gold = [question.answer for question in questions]
    return generation_agreement(checkpoint, small_cache, prompts, max_tokens, gold) | {"max_tokens": max_tokens}


# -- (ii) HF transformers ------------------------------------------------------------------------


def hf_model(checkpoint: Checkpoint, dtype: torch.dtype) -> Any:
    """A transformers model holding exactly the checkpoint's weights (as our engine loads them)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config: ModelConfig = checkpoint.config
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids),
    )
    if config.architecture == "qwen2":
        hf_config = Qwen2Config(**common)
    else:
        hf_config = LlamaConfig(**common, attention_bias=config.attention_bias)
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):  # no random initialisation: every weight comes from the checkpoint
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    weights = {name: tensor.to(dtype) for name, tensor in checkpoint.tensors.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF model does not match the checkpoint: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (the rotary frequencies) are not in the checkpoint: build them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"HF model tensors left unloaded: {leftover}")
    return model.eval()


class _StepClock:
    """A `generate` streamer recording when each decoding step's tokens exist (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, _: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


HF_SETTINGS = {
    "float32-dynamic": (torch.float32, "dynamic"),
    "float32-static": (torch.float32, "static"),
    "bfloat16-dynamic": (torch.bfloat16, "dynamic"),
}
HF_PROBE_PROMPT_TOKENS = 64
HF_PROBE_NEW_TOKENS = 8


def hf_batch_sizes(num_requests: int) -> list[int]:
    """The candidate batch sizes the workload fills (a batch larger than the workload is its first one)."""
    return [b for b in HF_BATCH_SIZES if b <= num_requests] or [HF_BATCH_SIZES[0]]


def probe_prompts(workload: Workload, batch_size: int) -> torch.Tensor:
    """`batch_size` rows of the workload's first prompts that are long enough, cut to the probe's length
    (repeated when the workload has too few)."""
    long_enough = [p[:HF_PROBE_PROMPT_TOKENS] for p in workload.prompts if len(p) >= HF_PROBE_PROMPT_TOKENS]
    return torch.tensor([long_enough[row % len(long_enough)] for row in range(batch_size)])


def probe_hf(
    checkpoint: Checkpoint, workload: Workload, pad_token_id: int, settings: Sequence[str], batch_sizes: Sequence[int]
) -> list[dict[str, Any]]:
    """Each (setting, batch size): one `generate` of that many prompts of HF_PROBE_PROMPT_TOKENS tokens with
    HF_PROBE_NEW_TOKENS new ones each, its seconds and output tokens/s."""
    rows = []
    for name in settings:
        dtype, cache = HF_SETTINGS[name]
        model = hf_model(checkpoint, dtype)
        with torch.inference_mode():
            kwargs: dict[str, Any] = dict(
                do_sample=False, pad_token_id=pad_token_id, cache_implementation="static" if cache == "static" else None
            )
            model.generate(probe_prompts(workload, 1)[:, :16], max_new_tokens=2, **kwargs)  # warm-up
            for batch_size in batch_sizes:
                prompts = probe_prompts(workload, batch_size)
                started = time.perf_counter()
                model.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=HF_PROBE_NEW_TOKENS,
                    min_new_tokens=HF_PROBE_NEW_TOKENS,
                    **kwargs,
                )
                seconds = time.perf_counter() - started
                rows.append(
                    {
                        "setting": name,
                        "batch_size": batch_size,
                        "seconds": seconds,
                        "output_tokens_per_s": batch_size * HF_PROBE_NEW_TOKENS / seconds,
                    }
                )
                print(
                    f"  HF probe {name}, batch {batch_size}: {seconds:.2f} s, "
                    f"{rows[-1]['output_tokens_per_s']:.1f} out tok/s",
                    flush=True,
                )
        del model
        gc.collect()
    return rows


def fastest(probe: Sequence[dict[str, Any]], dtype: torch.dtype | None = None) -> tuple[str, int]:
    """The probe's fastest (setting, batch size) by output tokens/s, among settings of `dtype` if given."""
    rows = [r for r in probe if dtype is None or HF_SETTINGS[r["setting"]][0] == dtype]
    best = max(rows, key=lambda r: r["output_tokens_per_s"])
    return best["setting"], best["batch_size"]


def bench_hf(model: Any, workload: Workload, pad_token_id: int, cache: str, batch_size: int) -> dict[str, float]:
    n = workload.output_tokens
    timings: list[RequestTiming] = []
    with torch.inference_mode():
        model.generate(torch.tensor([workload.prompts[0][:16]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_token_id)  # warm-up  # fmt: skip
        started = time.perf_counter()
        for first in range(0, len(workload.prompts), batch_size):
            indices = range(first, min(first + batch_size, len(workload.prompts)))
            last_arrival = started + max(workload.arrivals[i] for i in indices)
            time.sleep(max(0.0, last_arrival - time.perf_counter()))
            longest = max(len(workload.prompts[i]) for i in indices)
            input_ids = torch.full((len(indices), longest), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(indices), longest), dtype=torch.long)
            for row, i in enumerate(indices):  # left padding: every row's last token is a real one
                prompt = workload.prompts[i]
                input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
                attention_mask[row, longest - len(prompt) :] = 1
            clock = _StepClock()
            model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=pad_token_id, streamer=clock,
                cache_implementation="static" if cache == "static" else None,
            )  # fmt: skip
            for i in indices:
                timings.append(RequestTiming(arrival=started + workload.arrivals[i], token_times=list(clock.times)))
            print(f"  HF batch {first // batch_size + 1} done at {time.perf_counter() - started:.0f} s", flush=True)
    return summarise(timings, started)


# -- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="demo model name (tiny|small|large) or a model path")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (overloads a CPU)")
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 output tokens, prompts up to 400")
    parser.add_argument(
        "--hf-setting",
        default="auto",
        choices=["auto", *HF_SETTINGS],
        help="HF weights dtype and KV cache; auto: the fastest in a short probe",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help=f"HF generate's static batch size; default: the fastest of {HF_BATCH_SIZES} in the probe",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads for both systems (default: physical cores)"
    )
    parser.add_argument(
        "--same-precision",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run our engine and HF both in float32 (the same-precision ratio)",
    )
    engine_flags = parser.add_argument_group(
        "our engine", "each unset flag keeps the shipped tier spec's value (engines/<model>/spec.py)"
    )
    engine_flags.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="our engine's dtype")
    engine_flags.add_argument("--quantization", default=None, choices=["none", "auto", "w8a8", "int8", "int4"])
    engine_flags.add_argument("--w8a8-attention-passes", type=int, default=None, choices=[1, 2],
                              help="w8a8: int8 passes over the attention projections' inputs")
    engine_flags.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16"])
    engine_flags.add_argument("--kv-cache-mb", type=int, default=None)
    engine_flags.add_argument("--max-num-seqs", type=int, default=None)
    engine_flags.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine_flags.add_argument("--speculative-draft", default=None,
                              help="speculative decoding's drafter (a demo name or a path; \"\" = off), as "
                                   "`[tiers.<tier>] speculative_draft` sets it")
    parser.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    parser.add_argument("--skip-quality", action="store_true",
                        help="speed only: no perplexity or decode-path quality against float32 (comparing runs of one "
                             "precision, e.g. with and without a drafter)")
    parser.add_argument(
        "--batch1-only",
        action="store_true",
        help="only batch-1 decode against the memory roofline (a few minutes, not the workload)",
    )
    parser.add_argument("--batch1-tokens", type=int, default=64, help="decode steps timed at batch 1")
    parser.add_argument(
        "--batch1-repeats",
        type=int,
        default=3,
        help="--batch1-only: alternating runs with and without the CPU decode kernels",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-amx", action="store_true",
                        help="build w8a8 layers and attention as on a CPU without AMX (VNNI, vdpbf16ps), on a CPU "
                             "that has it")
    args = parser.parse_args(argv)
    if args.without_amx:
        run_without_amx()
    if args.batch1_tokens < DECODE_WARMUP_STEPS + 2:
        parser.error(f"--batch1-tokens must be at least {DECODE_WARMUP_STEPS + 2}: {DECODE_WARMUP_STEPS} warm-up steps "
                     "come first")  # fmt: skip
    if args.quick:
        args.requests, args.output_tokens = min(args.requests, 16), min(args.output_tokens, 32)
    max_prompt = 400 if args.quick else 800

    model_path = resolve_model(args.model)
    print(f"loading {model_path}")
    checkpoint = STEP_THREAD.call(functools.partial(load_checkpoint, model_path))
    workload, source, fresh_tokens = build_workload(
        checkpoint.tokenizer, args.requests, args.output_tokens, args.rate, max_prompt, args.seed
    )
    print(
        f"workload: {args.requests} requests at {args.rate}/s, prompts {min(map(len, workload.prompts))}–"
        f"{max(map(len, workload.prompts))} tokens from {source}, {sum(workload.shares_system_prompt)} sharing a "
        f"{SYSTEM_PROMPT_TOKENS}-token system prompt, {args.output_tokens} output tokens each"
    )
    from engines.llm_engine import physical_core_count

    args.threads = args.threads or physical_core_count()
    STEP_THREAD.call(functools.partial(torch.set_num_threads, args.threads))
    spec = shipped_spec(args)
    config = engine_config(spec, args)
    overridden = {flag: getattr(args, flag) for flag in ENGINE_FLAGS if getattr(args, flag) is not None}
    source_of_spec = f"engines/{spec.name}/spec.py" if spec.name in DEMO_TIERS else "TierSpec defaults"
    print(f"our engine: the {spec.name!r} tier spec ({source_of_spec}), overridden: {overridden or 'nothing'}")
    if args.batch1_only:
        STEP_THREAD.call(functools.partial(run_batch1_only, checkpoint, args, model_path, workload))
        return

    # HF: the probe, then its models built before the engine may cast or quantise tensors.
    hf_models: dict[str, Any] = {}  # setting -> model
    hf_probe: list[dict[str, Any]] = []
    hf_best: tuple[str, int] | None = None
    hf_float32: tuple[str, int] | None = None
    if not args.skip_hf:
        eos = checkpoint.config.eos_token_ids
        pad_token_id = eos[0] if eos else 0
        settings = list(HF_SETTINGS) if args.hf_setting == "auto" else [args.hf_setting]
        if args.same_precision and args.hf_setting != "auto" and HF_SETTINGS[args.hf_setting][0] != torch.float32:
            settings += [name for name, (dtype, _) in HF_SETTINGS.items() if dtype == torch.float32]
        batch_sizes = [args.hf_batch_size] if args.hf_batch_size else hf_batch_sizes(len(workload.prompts))
        print(f"probing HF generate: settings {settings} × batch sizes {batch_sizes} ...", flush=True)
        probe_started = time.perf_counter()
        probe = functools.partial(probe_hf, checkpoint, workload, pad_token_id, settings, batch_sizes)
        hf_probe = STEP_THREAD.call(probe)
        print(f"  probe took {time.perf_counter() - probe_started:.0f} s")
        hf_best = fastest([r for r in hf_probe if args.hf_setting in ("auto", r["setting"])])
        args.hf_setting = hf_best[0]
        if args.same_precision:
            hf_float32 = fastest(hf_probe, torch.float32)
        for setting, _ in hf_runs_planned(hf_best, hf_float32):
            if setting not in hf_models:
                hf_models[setting] = STEP_THREAD.call(functools.partial(hf_model, checkpoint, HF_SETTINGS[setting][0]))
    print_hf_probe(hf_probe, hf_best, hf_float32)

    print(f"running our engine ({args.model} tier spec) ...", flush=True)
    ours = asyncio.run(bench_engine(checkpoint, config, workload, fresh_tokens, args.batch1_tokens))
    engine_figures, prefix = ours["figures"], ours["cached_prefix_ttft"]
    print(
        f"  sluice engine {ours['precision']}: {engine_figures['output_tokens_per_s']:.2f} out tok/s, TTFT p99 "
        f"{engine_figures['ttft_p99_s']:.1f} s",
        flush=True,
    )
    float32_config: EngineConfig | None = None
    ours_float32: dict[str, Any] | None = None
    if args.same_precision:
        float32_config = same_precision_config(config, engine_figures["kv_blocks_total"])
        print(f"running our engine in float32 ({engine_figures['kv_blocks_total']} KV blocks) ...", flush=True)
        ours_float32 = asyncio.run(bench_engine(checkpoint, float32_config, workload, fresh_tokens, None))
        print(
            f"  sluice engine {ours_float32['precision']}: {ours_float32['figures']['output_tokens_per_s']:.2f} "
            f"out tok/s, TTFT p99 {ours_float32['figures']['ttft_p99_s']:.1f} s",
            flush=True,
        )
    print("batch-1 decode against the memory roofline ...", flush=True)
    batch1 = ours["batch1"]
    print_batch1(args.model, batch1)
    quality: dict[str, Any] | None = None
    decode_quality: dict[str, Any] | None = None
    if not args.skip_quality:
        print("measuring quality against float32 ...", flush=True)
        unused_texts = _corpus_texts()[1][-400:]  # the system prompts come from the start of these
        quality_tokens = token_stream(checkpoint.tokenizer, unused_texts, QUALITY_TOKENS)[:QUALITY_TOKENS]
        quality = STEP_THREAD.call(functools.partial(quality_vs_float32, checkpoint, config, quality_tokens))
        print("measuring decode-path quality against float32 ...", flush=True)
        decode_quality = STEP_THREAD.call(functools.partial(decode_quality_vs_float32, checkpoint, config))
    del checkpoint
    gc.collect()

    hf_runs: dict[tuple[str, int], dict[str, float]] = {}
    for setting, batch_size in hf_runs_planned(hf_best, hf_float32):
        print(f"running HF transformers generate, {setting}, static batches of {batch_size} ...", flush=True)
        cache = HF_SETTINGS[setting][1]
        run_hf = functools.partial(bench_hf, hf_models[setting], workload, pad_token_id, cache, batch_size)
        hf_runs[(setting, batch_size)] = STEP_THREAD.call(run_hf)
    hf_models.clear()
    hf_figures = hf_runs[hf_best] if hf_best else None
    hf_float32_figures = hf_runs[hf_float32] if hf_float32 else None

    precision = ours["precision"]
    ours_label = f"sluice engine ({precision['quantization']} weights, {precision['kv_cache_dtype']} KV)"
    rows = [[ours_label, *_row(engine_figures)]]
    if ours_float32:
        rows.append(["sluice engine (float32 throughout)", *_row(ours_float32["figures"])])
    for (setting, batch_size), figures in hf_runs.items():
        rows.append([f"HF generate ({setting}, batch {batch_size})", *_row(figures)])
    print_table(
        f"engine benchmark: {args.model}; ours: {source_of_spec}, overridden: {overridden or 'nothing'}; "
        f"{args.threads} threads",
        ["system", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s"],
        rows,
    )
    speedup = prefix["uncached_s"] / prefix["cached_s"]
    print_table(
        "KV cache and prefix cache (sluice engine)",
        ["run", "KV blocks used (mean)", "KV blocks allocated", "KV waste %", "prefix hit rate", "preemptions"],
        [[name, f["kv_blocks_used_mean"], f["kv_blocks_total"], f["kv_waste_pct"], f["prefix_cache_hit_rate"],
          f["preemptions"]] for name, f in [("shipped", engine_figures),
                                            *([("float32", ours_float32["figures"])] if ours_float32 else [])]],
    )  # fmt: skip
    print_table(
        f"TTFT with a {SYSTEM_PROMPT_TOKENS}-token system prompt (median of {CACHED_PREFIX_TRIALS})",
        ["uncached s", "cached s", "speedup x"],
        [[prefix["uncached_s"], prefix["cached_s"], speedup]],
    )

    if quality is not None:
        print_table(
            f"Quality against float32 (teacher-forced, {quality['tokens']} held-out tokens)",
            ["perplexity float32", "perplexity ours", "increase %", "top-1 agreement %"],
            [[quality["perplexity_float32"], quality["perplexity_ours"], quality["perplexity_increase_pct"],
              quality["top1_agreement_with_float32_pct"]]],
        )  # fmt: skip
    if decode_quality is not None:
        print_decode_quality(decode_quality)

    comparison: dict[str, Any] = {}
    if hf_figures:
        comparison = {
            "throughput_ours_over_hf_x": engine_figures["output_tokens_per_s"] / hf_figures["output_tokens_per_s"],
            "ttft_p99_ours_over_hf": engine_figures["ttft_p99_s"] / hf_figures["ttft_p99_s"],
        }
    same_precision: dict[str, Any] | None = None
    if ours_float32 is not None and float32_config is not None:
        same_precision = {
            "sluice_engine_config": {
                "dtype": float32_config.dtype,
                "quantization": "none",
                "kv_cache_dtype": "float32",
                "num_kv_blocks": float32_config.num_kv_blocks,
            },
            "sluice_engine_float32": ours_float32["figures"],
            "hf_setting": hf_float32[0] if hf_float32 else None,
            "hf_batch_size": hf_float32[1] if hf_float32 else None,
            "hf_transformers_generate_float32": hf_float32_figures,
        }
        if hf_float32_figures:
            same_precision["throughput_ratio"] = comparison["same_precision_throughput_ratio"] = (
                ours_float32["figures"]["output_tokens_per_s"] / hf_float32_figures["output_tokens_per_s"]
            )
            same_precision["ttft_p99_ratio"] = comparison["same_precision_ttft_p99_ours_over_hf"] = (
                ours_float32["figures"]["ttft_p99_s"] / hf_float32_figures["ttft_p99_s"]
            )
    full_stack_ratio = comparison.get("throughput_ours_over_hf_x")
    same_precision_ratio = comparison.get("same_precision_throughput_ratio")
    targets = {
        "throughput_at_least_3x_hf": comparison.get("throughput_ours_over_hf_x", 0) >= 3,
        "ttft_p99_no_worse_than_hf": comparison.get("ttft_p99_ours_over_hf", float("inf")) <= 1,
        "kv_waste_below_4_pct": engine_figures["kv_waste_pct"] < 4,
        "cached_prefix_ttft_at_least_5x_sooner": speedup >= 5,
        "batch1_decode_at_least_60_pct_of_roofline": batch1["roofline_fraction_pct"] >= 60,
        "same_precision_at_least_2x": (same_precision_ratio or 0) >= 2,
        "full_stack_at_least_5x_within_1pct_perplexity": (full_stack_ratio or 0) >= 5
        and quality is not None and quality["perplexity_increase_pct"] <= 1,
    }
    if hf_best is not None and full_stack_ratio is not None:
        ratio_rows = [["full-stack", ours_label, f"HF {hf_best[0]}, batch {hf_best[1]}", full_stack_ratio,
                       comparison["ttft_p99_ours_over_hf"], "≥ 5× within +1% perplexity",
                       targets["full_stack_at_least_5x_within_1pct_perplexity"]]]  # fmt: skip
        if hf_float32 is not None and same_precision_ratio is not None:
            ratio_rows.append(["same-precision", "sluice engine float32", f"HF {hf_float32[0]}, batch {hf_float32[1]}",
                               same_precision_ratio, comparison["same_precision_ttft_p99_ours_over_hf"], "≥ 2×",
                               targets["same_precision_at_least_2x"]])  # fmt: skip
        perplexity = "not measured" if quality is None else f"{quality['perplexity_increase_pct']:+.2f}%"
        print_table(
            f"Ours over HF in output tokens/s (full-stack perplexity {perplexity})",
            ["ratio", "ours", "HF", "throughput x", "TTFT p99 ours/HF", "target", "met"],
            ratio_rows,
        )
    print_table("Targets", ["target", "met"], [[name, met] for name, met in targets.items()])
    write_results(
        "engine",
        {
            "model": args.model,
            "model_path": str(model_path),
            "settings": {
                "dtype": spec.dtype,
                "quantization": spec.quantization or "none",
                "kv_cache_dtype": spec.kv_cache_dtype,
                "kv_cache_mb": spec.kv_cache_mb,
                "max_num_seqs": spec.max_num_seqs,
                "max_num_batched_tokens": spec.max_num_batched_tokens,
                "hf_batch_size": hf_best[1] if hf_best else None,
                "hf_setting": args.hf_setting,
                "hf_probe_s": {r["setting"]: r["seconds"] for r in hf_probe if r["batch_size"] == HF_BATCH_SIZES[0]},
                "threads": args.threads,
                "hf_attention": "sdpa",
                "engine_spec": f"engines.tiers.tier_spec({spec.name!r})",
                "engine_spec_overrides": overridden,
                "max_model_len": spec.max_model_len,
                "speculative_draft": spec.speculative_draft,
                "sluice_engine_precision": ours["precision"],
                "hf_best_batch_size": hf_best[1] if hf_best else None,
                "hf_probe_prompt_tokens": HF_PROBE_PROMPT_TOKENS,
                "hf_probe_new_tokens": HF_PROBE_NEW_TOKENS,
            },
            "workload": {
                "requests": args.requests,
                "arrival_rate_per_s": args.rate,
                "prompt_source": source,
                "prompt_tokens_min": min(map(len, workload.prompts)),
                "prompt_tokens_max": max(map(len, workload.prompts)),
                "prompt_tokens_mean": mean([len(p) for p in workload.prompts]),
                "requests_sharing_system_prompt": sum(workload.shares_system_prompt),
                "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
                "output_tokens_per_request": args.output_tokens,
                "decoding": "greedy, EOS ignored",
            },
            "sluice_engine": engine_figures,
            "hf_transformers_generate": hf_figures,
            "ours_vs_hf": comparison,
            "cached_prefix_ttft": {**prefix, "speedup_x": speedup},
            "batch1_decode": batch1,
            "quality_vs_float32": quality,
            "decode_quality_vs_float32": decode_quality,
            "targets": targets,
            "hf_probe": hf_probe,
            "hf_best_batch_size": hf_best[1] if hf_best else None,
            "same_precision": same_precision,
            "same_precision_throughput_ratio": same_precision_ratio,
        },
    )


def print_decode_quality(quality: dict[str, Any]) -> None:
    print_table(
        f"Quality against float32 on the decode path ({quality['answers']} GSM8K test questions, greedy, "
        f"up to {quality['max_tokens']} tokens)",
        ["token agreement %", "token-identical answers", "final-answer agreement %", "accuracy ours %",
         "accuracy float32 %"],
        [[quality["token_agreement_pct"], quality["token_identical_answers"], quality["final_answer_agreement_pct"],
          quality["accuracy_pct"], quality["reference_accuracy_pct"]]],
    )  # fmt: skip


def hf_runs_planned(best: tuple[str, int] | None, best_float32: tuple[str, int] | None) -> list[tuple[str, int]]:
    """The HF workload runs: the fastest (setting, batch size), then the fastest float32 one if that differs."""
    return list(dict.fromkeys(run for run in (best, best_float32) if run is not None))


def print_hf_probe(
    probe: Sequence[dict[str, Any]], best: tuple[str, int] | None, best_float32: tuple[str, int] | None
) -> None:
    if not probe:
        return

    def chosen(row: dict[str, Any]) -> str:
        key = (row["setting"], row["batch_size"])
        return ", ".join(label for label, pick in (("fastest", best), ("fastest float32", best_float32)) if key == pick)

    print_table(
        f"HF generate probe ({HF_PROBE_PROMPT_TOKENS}-token prompts, {HF_PROBE_NEW_TOKENS} new tokens each)",
        ["setting", "batch", "seconds", "out tok/s", "s per sequence", "chosen"],
        [[r["setting"], r["batch_size"], r["seconds"], r["output_tokens_per_s"], r["seconds"] / r["batch_size"],
          chosen(r)] for r in probe],
    )  # fmt: skip


def _row(figures: dict[str, float]) -> list[float]:
    return [figures[k] for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")]


if __name__ == "__main__":
    main()
