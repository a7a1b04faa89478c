"""Our engine against HF transformers `generate` on one loaded serving workload.

`python -m bench.engine [--model small] [--requests 64] [--quick]`

Workload: requests arrive as a Poisson process fast enough to keep the engine loaded; prompts of
50–800 tokens are cut from real text (GSM8K questions, /work/shared/data/gsm8k); 30% of them start
with the same 500-token system prompt; every request generates exactly `--output-tokens` tokens
(greedy, EOS ignored). Both systems load the same weights from the same checkpoint and see the same
prompts and arrival times:

  (i)  our AsyncLLMEngine (continuous batching, paged KV cache, prefix caching; float32 activations,
       int8 weights for few-row decode steps and float32 ones for prefill chunks);
  (ii) HF transformers `generate` in static batches of 8 in arrival order (SDPA attention, left
       padding, `torch.inference_mode`), each batch starting once its last request has arrived. With
       `--hf-setting auto` (the default) a short probe in the same run times each candidate setting
       (float32 or bfloat16 weights, dynamic or static KV cache) and the fastest one runs the workload.
Both run with the same torch intra-op thread count (`--threads`).

Batch-1 decode (`--batch1-only` runs just that): one greedy request alone after the workload, its
decode tokens/s as bytes of weights read per second (`decode_weight_bytes`) over the memory bandwidth a
large tensor read or copy reaches in the same run, just before and after (the roofline).

Reported: output tokens/s, TTFT and ITL p50/p99, KV waste (token slots allocated in held blocks
but not holding a token, averaged over the run), prefix-cache hit rate, and separately the TTFT of
a request whose 500-token system prompt is cached against the same request uncached, and what our
precision settings cost in quality: perplexity of 2048 held-out tokens and top-1 agreement with
float32 weights, activations and KV cache (same checkpoint, teacher-forced through our model code).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import mean, percentile, print_table, write_results
from engines.config import EngineConfig, ModelConfig
from engines.loader import Checkpoint, load_checkpoint
from engines.registry import resolve_model
from engines.sampling_params import SamplingParams

GSM8K_DIR = Path("/work/shared/data/gsm8k")
SYSTEM_PROMPT_TOKENS = 500
SHARED_PREFIX_FRACTION = 0.3
HF_BATCH_SIZE = 8
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


def engine_config(model_path: Path, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(model_path),
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_bytes=args.kv_cache_mb << 20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        num_threads=args.threads,
    )


async def bench_engine(
    checkpoint: Checkpoint, args: argparse.Namespace, model_path: Path, workload: Workload, fresh_tokens: list[int]
) -> dict[str, Any]:
    from engines.llm_engine import AsyncLLMEngine, LLMEngine

    llm_engine = LLMEngine.from_checkpoint(checkpoint, engine_config(model_path, args))
    async_engine = AsyncLLMEngine(llm_engine)
    try:
        # Warm-up outside the measurement (first-call allocations, thread pools).
        await first_token_seconds(async_engine, "warmup", workload.prompts[0][:32])
        before = async_engine.stats()
        timings, started, sampler = await run_engine(async_engine, workload)
        await asyncio.sleep(0.05)
        after = async_engine.stats()
        queries = after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens
        hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        question_tokens = [t for p in workload.prompts for t in p[-CACHED_PREFIX_QUESTION_TOKENS:]]
        uncached, cached = await cached_prefix_ttft(async_engine, fresh_tokens, question_tokens)
    finally:
        await async_engine.shutdown()
    batch1 = batch1_decode(llm_engine, workload.prompts[0][:BATCH1_PROMPT_TOKENS], args.batch1_tokens)
    figures = summarise(timings, started)
    figures.update(
        kv_blocks_total=after.kv_blocks_total,
        kv_blocks_used_mean=mean(sampler.blocks_used),
        kv_blocks_used_max=max(sampler.blocks_used, default=0),
        kv_waste_pct=sampler.waste_pct,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        preemptions=after.num_preempted_total - before.num_preempted_total,
    )
    return {"figures": figures, "cached_prefix_ttft": {"uncached_s": uncached, "cached_s": cached}, "batch1": batch1}


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
    from engines.speculative import weight_bytes

    embedding, head = model.embed_tokens, model.lm_head
    shared = {t.data_ptr() for t in [*embedding.parameters(), *embedding.buffers()]} & (
        {t.data_ptr() for t in [*head.parameters(), *head.buffers()]} if head is not None else set())
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
    steps = 0
    started = time.perf_counter()
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        steps += 1
    seconds = time.perf_counter() - started
    after = memory_bandwidth()
    roofline = (before["roofline_gb_s"] + after["roofline_gb_s"]) / 2
    weight_gb = decode_weight_bytes(llm_engine.model) / 1e9
    tokens_per_s = steps / seconds
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


def run_batch1_only(checkpoint: Checkpoint, args: argparse.Namespace, model_path: Path, workload: Workload) -> None:
    from engines.llm_engine import LLMEngine

    llm_engine = LLMEngine.from_checkpoint(checkpoint, engine_config(model_path, args))
    figures = batch1_decode(llm_engine, workload.prompts[0][:BATCH1_PROMPT_TOKENS], args.batch1_tokens)
    print_batch1(args.model, figures)
    write_results("engine_batch1", {
        "model": args.model, "model_path": str(model_path), "precision": llm_engine.precision(),
        "threads": args.threads, "decode_tokens": args.batch1_tokens, "prompt_tokens": BATCH1_PROMPT_TOKENS,
        "batch1_decode": figures, "target_at_least_60_pct_of_roofline": figures["roofline_fraction_pct"] >= 60,
    })


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
    at each position: chunks prefilled through the engine's own layers, quantisation and KV-cache
    dtype. The engine must be otherwise unused (its first cache slots are overwritten)."""
    from engines.attention import AttentionMetadata, PrefillChunk

    model, runner = llm_engine.model, llm_engine.runner
    total, count, argmaxes = 0.0, 0, []
    for start in range(0, len(token_ids) - 1, QUALITY_CHUNK_TOKENS):
        chunk = torch.tensor(token_ids[start : start + QUALITY_CHUNK_TOKENS + 1])
        positions = torch.arange(len(chunk))
        metadata = AttentionMetadata(
            block_size=runner.block_size,
            slot_mapping=positions,
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_mask=None,
            prefills=[PrefillChunk(0, len(chunk), 0, block_table=None, mask=None)],
        )
        logits = model.compute_logits(model(chunk, positions, runner.kv_caches, metadata)).float()[:-1]
        total -= torch.log_softmax(logits, dim=-1).gather(1, chunk[1:, None]).sum().item()
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


HF_SETTINGS = {"float32-dynamic": (torch.float32, "dynamic"), "float32-static": (torch.float32, "static"),
               "bfloat16-dynamic": (torch.bfloat16, "dynamic")}
HF_PROBE_PROMPT_TOKENS = 64
HF_PROBE_NEW_TOKENS = 8


def probe_hf_settings(checkpoint: Checkpoint, workload: Workload, pad_token_id: int) -> dict[str, float]:
    """Seconds one batch of 8 short prompts takes through `generate` in each candidate setting."""
    prompts = torch.tensor([p[:HF_PROBE_PROMPT_TOKENS] for p in workload.prompts[:HF_BATCH_SIZE]
                            if len(p) >= HF_PROBE_PROMPT_TOKENS])
    seconds = {}
    for name, (dtype, cache) in HF_SETTINGS.items():
        model = hf_model(checkpoint, dtype)
        with torch.inference_mode():
            kwargs: dict[str, Any] = dict(do_sample=False, pad_token_id=pad_token_id,
                                          cache_implementation="static" if cache == "static" else None)
            model.generate(prompts[:1, :16], max_new_tokens=2, **kwargs)  # warm-up
            started = time.perf_counter()
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=HF_PROBE_NEW_TOKENS,
                           min_new_tokens=HF_PROBE_NEW_TOKENS, **kwargs)
            seconds[name] = time.perf_counter() - started
        print(f"  HF probe {name}: {seconds[name]:.2f} s")
        del model
        gc.collect()
    return seconds


def bench_hf(model: Any, workload: Workload, pad_token_id: int, cache: str) -> dict[str, float]:
    n = workload.output_tokens
    timings: list[RequestTiming] = []
    with torch.inference_mode():
        model.generate(torch.tensor([workload.prompts[0][:16]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_token_id)  # warm-up  # fmt: skip
        started = time.perf_counter()
        for first in range(0, len(workload.prompts), HF_BATCH_SIZE):
            indices = range(first, min(first + HF_BATCH_SIZE, len(workload.prompts)))
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
            print(f"  HF batch {first // HF_BATCH_SIZE + 1} done at {time.perf_counter() - started:.0f} s", flush=True)
    return summarise(timings, started)


# -- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="demo model name (tiny|small|large) or a model path")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (overloads a CPU)")
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 output tokens, prompts up to 400")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="our engine's dtype")
    parser.add_argument("--hf-setting", default="auto", choices=["auto", *HF_SETTINGS],
                        help="HF weights dtype and KV cache; auto: the fastest in a short probe")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both systems (default: physical cores)")
    parser.add_argument("--quantization", default="auto", choices=["none", "auto", "w8a8", "int8", "int4"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    parser.add_argument("--batch1-only", action="store_true",
                        help="only batch-1 decode against the memory roofline (a few minutes, not the workload)")
    parser.add_argument("--batch1-tokens", type=int, default=64, help="decode steps timed at batch 1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens = min(args.requests, 16), min(args.output_tokens, 32)
    max_prompt = 400 if args.quick else 800

    model_path = resolve_model(args.model)
    print(f"loading {model_path}")
    checkpoint = load_checkpoint(model_path)
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
    torch.set_num_threads(args.threads)
    if args.batch1_only:
        run_batch1_only(checkpoint, args, model_path, workload)
        return
    hf, hf_probe = None, {}
    if not args.skip_hf:  # before the engine may cast or quantise tensors
        eos = checkpoint.config.eos_token_ids
        pad_token_id = eos[0] if eos else 0
        if args.hf_setting == "auto":
            print("probing HF generate settings ...")
            hf_probe = probe_hf_settings(checkpoint, workload, pad_token_id)
            args.hf_setting = min(hf_probe, key=hf_probe.__getitem__)
        hf_dtype, hf_cache = HF_SETTINGS[args.hf_setting]
        hf = hf_model(checkpoint, hf_dtype)

    print("running our engine ...")
    ours = asyncio.run(bench_engine(checkpoint, args, model_path, workload, fresh_tokens))
    engine_figures, prefix = ours["figures"], ours["cached_prefix_ttft"]
    print(f"  sluice engine: {engine_figures['output_tokens_per_s']:.2f} out tok/s, TTFT p99 "
          f"{engine_figures['ttft_p99_s']:.1f} s", flush=True)
    print("batch-1 decode against the memory roofline ...", flush=True)
    batch1 = ours["batch1"]
    print_batch1(args.model, batch1)
    print("measuring quality against float32 ...", flush=True)
    unused_texts = _corpus_texts()[1][-400:]  # the system prompts come from the start of these
    quality_tokens = token_stream(checkpoint.tokenizer, unused_texts, QUALITY_TOKENS)[:QUALITY_TOKENS]
    quality = quality_vs_float32(checkpoint, engine_config(model_path, args), quality_tokens)
    del checkpoint
    gc.collect()

    hf_figures: dict[str, float] | None = None
    if hf is not None:
        print(f"running HF transformers generate, static batches of {HF_BATCH_SIZE} ...")
        hf_figures = bench_hf(hf, workload, pad_token_id, hf_cache)

    rows = [["sluice engine", *_row(engine_figures)]]
    if hf_figures:
        rows.append([f"HF generate (batch {HF_BATCH_SIZE})", *_row(hf_figures)])
    print_table(
        f"engine benchmark: {args.model}; ours {args.dtype}, weights {args.quantization}; HF {args.hf_setting}; "
        f"{args.threads} threads",
        ["system", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s"],
        rows,
    )
    speedup = prefix["uncached_s"] / prefix["cached_s"]
    print_table(
        "KV cache and prefix cache (sluice engine)",
        ["KV blocks used (mean)", "KV blocks allocated", "KV waste %", "prefix hit rate", "preemptions"],
        [[engine_figures["kv_blocks_used_mean"], engine_figures["kv_blocks_total"], engine_figures["kv_waste_pct"],
          engine_figures["prefix_cache_hit_rate"], engine_figures["preemptions"]]],
    )  # fmt: skip
    print_table(
        f"TTFT with a {SYSTEM_PROMPT_TOKENS}-token system prompt (median of {CACHED_PREFIX_TRIALS})",
        ["uncached s", "cached s", "speedup x"],
        [[prefix["uncached_s"], prefix["cached_s"], speedup]],
    )

    print_table(
        f"Quality against float32 (teacher-forced, {quality['tokens']} held-out tokens)",
        ["perplexity float32", "perplexity ours", "increase %", "top-1 agreement %"],
        [[quality["perplexity_float32"], quality["perplexity_ours"], quality["perplexity_increase_pct"],
          quality["top1_agreement_with_float32_pct"]]],
    )  # fmt: skip

    comparison: dict[str, Any] = {}
    if hf_figures:
        comparison = {
            "throughput_ours_over_hf_x": engine_figures["output_tokens_per_s"] / hf_figures["output_tokens_per_s"],
            "ttft_p99_ours_over_hf": engine_figures["ttft_p99_s"] / hf_figures["ttft_p99_s"],
        }
    write_results(
        "engine",
        {
            "model": args.model,
            "model_path": str(model_path),
            "settings": {
                "dtype": args.dtype, "quantization": args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_mb": args.kv_cache_mb,
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "hf_batch_size": HF_BATCH_SIZE, "hf_setting": args.hf_setting, "hf_probe_s": hf_probe,
                "threads": args.threads,
                "hf_attention": "sdpa",
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
            "targets": {
                "throughput_at_least_3x_hf": comparison.get("throughput_ours_over_hf_x", 0) >= 3,
                "ttft_p99_no_worse_than_hf": comparison.get("ttft_p99_ours_over_hf", float("inf")) <= 1,
                "kv_waste_below_4_pct": engine_figures["kv_waste_pct"] < 4,
                "cached_prefix_ttft_at_least_5x_sooner": speedup >= 5,
                "batch1_decode_at_least_60_pct_of_roofline": batch1["roofline_fraction_pct"] >= 60,
            },
        },
    )


def _row(figures: dict[str, float]) -> list[float]:
    return [figures[k] for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")]


if __name__ == "__main__":
    main()
