"""Quality per precision format against float32, beside its memory and decode speed (issue #15).

`python -m bench.quant_quality [--models small large] [--formats float32 bf16 int8 w8a8 w8a8-one-pass int4]
[--questions 100] [--max-tokens 256] [--ppl-tokens 2048] [--threads N] [--data DIR]`

Each demo model's checkpoint is loaded once; one engine per format is built from it in turn (the
previous one freed first), everything but the precision equal:

  float32  float32 weights, activations and KV cache (the reference);
  bf16     bfloat16 weights, activations and KV cache;
  int8     int8 weights (per output row), float32 activations;
  w8a8     int8 weights and per-row int8 activations, the attention projections' inputs in two int8 passes
           (`w8a8_attention_passes = 2`, the default);
  w8a8-one-pass  the same with every input in one pass (`w8a8_attention_passes = 1`);
  int4     int4 weights, float32 activations;

the quantised ones with the KV cache that ships (`kv_cache_dtype = "auto"`: bfloat16 where the CPU has
it natively). Per model and format:

  perplexity  of the first `--ppl-tokens` tokens of GSM8K train question + answer text, teacher-forced
              through the engine's own layers (`bench.engine.teacher_forced`), its increase over
              float32, and top-1 agreement with float32's argmaxes;
  generation  greedy answers through the engine's decode path (continuous batching, 16 sequences at
              once, up to `--max-tokens` tokens, stopping at EOS) to the first `--questions` GSM8K test
              questions as chat prompts: final-answer agreement with float32's answers (an answer
              without a number disagrees; how many had none is counted), accuracy against GSM8K's
              reference, and token agreement (the mean fraction of each answer before its first token
              that differs from float32's, and how many answers are token-identical);
  memory      bytes of the weights (all of them, and what one decode step reads) and the process's
              resident memory once the engine is built;
  speed       batch-1 decode tokens/s (`bench.engine.batch1_decode`, against the memory roofline) and
              batch-16 decode tokens/s (16 requests together, only steps after every prefill timed).

Prints one table per model and writes bench/results/quant_quality.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, mean, print_table, write_results
from bench.engine import (
    GSM8K_DIR,
    batch1_decode,
    decode_weight_bytes,
    gsm8k_worked_answers,
    teacher_forced,
    token_stream,
)
from bench.speculative import first_divergences, gsm8k_prompts, run
from engines.config import EngineConfig
from engines.cpu import release_free_memory
from engines.llm_engine import LLMEngine, physical_core_count
from engines.loader import Checkpoint, load_checkpoint
from engines.registry import resolve_model
from engines.sampling_params import SamplingParams
from engines.speculative import weight_bytes
from engines.tokenizer import Tokenizer
from router.label import final_number, is_correct, load_gsm8k
from router.shadow import final_answer_agreement

REFERENCE = "float32"
FORMATS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32", "quantization": None, "kv_cache_dtype": "float32"},
    "bf16": {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "auto"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8", "kv_cache_dtype": "auto"},
    "w8a8-one-pass": {"dtype": "float32", "quantization": "w8a8", "kv_cache_dtype": "auto", "w8a8_attention_passes": 1},
    "int4": {"dtype": "float32", "quantization": "int4", "kv_cache_dtype": "auto"},
}
MAX_NUM_SEQS = 16
SPEED_BATCH = 16
SPEED_WARMUP_STEPS = 2


def format_config(config: EngineConfig, name: str) -> EngineConfig:
    """`config` with the precision of format `name` (everything else unchanged)."""
    return dataclasses.replace(config, **FORMATS[name])


# -- data ----------------------------------------------------------------------------------------


def check_data(directory: Path) -> None:
    missing = [
        directory / f"{split}.jsonl" for split in ("train", "test") if not (directory / f"{split}.jsonl").is_file()
    ]
    if missing:
        raise SystemExit(
            f"GSM8K not found ({', '.join(map(str, missing))} missing): this benchmark needs the GSM8K train and "
            "test splits (see /work/shared/data); pass their directory with --data"
        )


def train_tokens(tokenizer: Tokenizer, directory: Path, count: int) -> list[int]:
    """The first `count` tokens of GSM8K train questions, each followed by its worked answer."""
    texts = gsm8k_worked_answers(directory, 0, -(-count // 64))  # no GSM8K example is shorter than 64 tokens
    ids = token_stream(tokenizer, texts, count)[:count]
    if len(ids) < count:
        raise ValueError(f"only {len(ids)} tokens of GSM8K train text; asked for {count}")
    return ids


# -- generation agreement ------------------------------------------------------------------------


def greedy_answers(llm_engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids, stopping at EOS) to every prompt, all queued at once so the engine's
    continuous batching runs up to `max_num_seqs` of them together."""
    return run(llm_engine, prompts, len(prompts), max_tokens)["outputs"]


def token_agreement(reference: Sequence[int], answer: Sequence[int]) -> float:
    """The fraction of an answer before its first token that differs from the reference (of the longer
    of the two): 1.0 exactly when they are identical."""
    divergence = first_divergences([list(reference)], [list(answer)])[0]
    if divergence is None:
        return 1.0
    return divergence / max(len(reference), len(answer))


def score_answers(
    reference_texts: Sequence[str], texts: Sequence[str], gold: Sequence[float] | None = None
) -> dict[str, Any]:
    """Final-answer agreement of `texts` with `reference_texts` (an answer pair where either states no
    number counts as disagreeing), how many had no number, and accuracy against `gold` when given."""
    agreements = [
        final_answer_agreement(text, reference) for text, reference in zip(texts, reference_texts, strict=True)
    ]
    scored: dict[str, Any] = {
        "answers": len(texts),
        "final_answer_agreement_pct": 100 * sum(a == 1.0 for a in agreements) / len(texts),
        "final_answer_pairs_without_number": sum(a is None for a in agreements),
        "answers_without_number": sum(final_number(text) is None for text in texts),
        "reference_answers_without_number": sum(final_number(text) is None for text in reference_texts),
        "final_answers_differing": [i for i, a in enumerate(agreements) if a != 1.0],
    }
    if gold is not None:
        scored["accuracy_pct"] = 100 * sum(is_correct(t, g) for t, g in zip(texts, gold, strict=True)) / len(texts)
        scored["reference_accuracy_pct"] = (
            100 * sum(is_correct(t, g) for t, g in zip(reference_texts, gold, strict=True)) / len(texts)
        )
    return scored


def compare_generations(
    tokenizer: Tokenizer,
    reference: Sequence[list[int]],
    answers: Sequence[list[int]],
    gold: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Greedy `answers` against the `reference` ones to the same prompts: final answers (`score_answers`)
    and tokens (mean `token_agreement`, how many are token-identical)."""
    agreement = [token_agreement(r, a) for r, a in zip(reference, answers, strict=True)]
    scored = score_answers([tokenizer.decode(r) for r in reference], [tokenizer.decode(a) for a in answers], gold)
    return {
        **scored,
        "token_agreement_pct": 100 * mean(agreement),
        "token_identical_answers": sum(a == 1.0 for a in agreement),
        "answer_tokens_mean": mean([len(a) for a in answers]),
        "reference_answer_tokens_mean": mean([len(r) for r in reference]),
    }


def generation_agreement(
    checkpoint: Checkpoint,
    config: EngineConfig,
    prompts: list[list[int]],
    max_tokens: int,
    gold: Sequence[float] | None = None,
    reference: Sequence[list[int]] | None = None,
) -> dict[str, Any]:
    """What `config`'s precision costs on the decode path: its greedy answers against those of the same
    settings in float32 (`reference`, when already generated, else generated here), one engine at a time."""
    if reference is None:
        reference = _answers_of(checkpoint, format_config(config, REFERENCE), prompts, max_tokens)
    answers = _answers_of(checkpoint, config, prompts, max_tokens)
    return compare_generations(checkpoint.tokenizer, reference, answers, gold)


def _answers_of(
    checkpoint: Checkpoint, config: EngineConfig, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    llm_engine = LLMEngine.from_checkpoint(checkpoint, config)
    try:
        return greedy_answers(llm_engine, prompts, max_tokens)
    finally:
        del llm_engine
        _free()


def _free() -> None:
    gc.collect()
    release_free_memory()


# -- speed and memory ----------------------------------------------------------------------------


def batch_decode(llm_engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Decode tokens/s with every prompt running at once: all requests queued, stepped until each has
    its first token (every prefill done) and a few steps more, then `steps` decode steps timed (the
    requests cannot finish before: EOS ignored); the requests are dropped afterwards."""
    params = SamplingParams(temperature=0, max_tokens=steps + SPEED_WARMUP_STEPS + 64, ignore_eos=True)
    ids = [f"batch-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm_engine.add_request(request_id, prompt, params)
    started_ids: set[str] = set()
    while len(started_ids) < len(ids):
        started_ids.update(o.request_id for o in llm_engine.step() if o.new_token_ids)
    for _ in range(SPEED_WARMUP_STEPS):
        llm_engine.step()
    tokens = 0
    started = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in llm_engine.step())
    seconds = time.perf_counter() - started
    for request_id in ids:
        llm_engine.abort_request(request_id)
    return {"batch": len(prompts), "decode_tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds / steps}


def resident_gb() -> float:
    """The process's resident memory now (VmRSS), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


# -- one model -----------------------------------------------------------------------------------


def measure_format(
    checkpoint: Checkpoint,
    config: EngineConfig,
    ppl_tokens: list[int],
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], torch.Tensor, list[list[int]]]:
    """Every figure of one format but the comparisons: (figures, argmaxes, greedy answers)."""
    started = time.perf_counter()
    llm_engine = LLMEngine.from_checkpoint(checkpoint, config)
    figures: dict[str, Any] = {
        "precision": llm_engine.precision(),
        "load_s": time.perf_counter() - started,
        "weight_gb": weight_bytes(llm_engine.model) / 1e9,
        "decode_weight_gb_per_token": decode_weight_bytes(llm_engine.model) / 1e9,
        "rss_after_load_gb": resident_gb(),
    }
    nll, argmaxes = teacher_forced(llm_engine, ppl_tokens)  # first: it needs an otherwise unused engine
    figures["nll_per_token"], figures["perplexity"] = nll, math.exp(nll)
    started = time.perf_counter()
    answers = greedy_answers(llm_engine, prompts, args.max_tokens)
    figures["generation_s"] = time.perf_counter() - started
    figures["generated_tokens"] = sum(map(len, answers))
    figures["batch1_decode"] = batch1_decode(llm_engine, prompts[0], args.speed_tokens)
    figures[f"batch{SPEED_BATCH}_decode"] = batch_decode(llm_engine, _speed_prompts(prompts), args.speed_tokens)
    del llm_engine
    _free()
    return figures, argmaxes, answers


def _speed_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(SPEED_BATCH)]


def bench_model(model: str, args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    model_path = resolve_model(model)
    print(f"\n== {model}: loading {model_path}", flush=True)
    checkpoint = load_checkpoint(model_path)
    base = EngineConfig(
        model=str(model_path),
        kv_cache_bytes=args.kv_cache_mb << 20,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=512,
        max_model_len=4096,
        num_threads=args.threads,
    )
    ppl_tokens = train_tokens(checkpoint.tokenizer, args.data, args.ppl_tokens)
    questions = load_gsm8k(args.data, "test", args.questions)
    # The prompts are built from the same first lines of test.jsonl (load_gsm8k skips none: all have a number).
    prompts = gsm8k_prompts(checkpoint, args.data / "test.jsonl", args.questions)  # it needs only `.tokenizer`
    assert len(prompts) == len(questions), "GSM8K test questions and prompts out of step"
    gold = [q.answer for q in questions]
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for name in args.formats:
        started = time.perf_counter()
        figures, argmaxes, answers = measure_format(checkpoint, format_config(base, name), ppl_tokens, prompts, args)
        if name == REFERENCE:
            reference = {"figures": figures, "argmaxes": argmaxes, "answers": answers}
        ref = reference["figures"]
        generation = compare_generations(checkpoint.tokenizer, reference["answers"], answers, gold)
        row = {
            "model": model, "model_path": str(model_path), "format": name, "cpu_model": cpu_model(),
            "threads": args.threads, **figures,
            "perplexity_float32": ref["perplexity"],
            "perplexity_increase_pct": (math.exp(figures["nll_per_token"] - ref["nll_per_token"]) - 1) * 100,
            "top1_agreement_with_float32_pct": (argmaxes == reference["argmaxes"]).float().mean().item() * 100,
            "generation_vs_float32": generation,
            "weight_gb_float32": ref["weight_gb"],
            "weight_fraction_of_float32": figures["weight_gb"] / ref["weight_gb"],
            "batch1_decode_tokens_per_s_float32": ref["batch1_decode"]["decode_tokens_per_s"],
            f"batch{SPEED_BATCH}_decode_tokens_per_s_float32": ref[f"batch{SPEED_BATCH}_decode"]["decode_tokens_per_s"],
            "seconds": time.perf_counter() - started,
        }  # fmt: skip
        rows.append(row)
        on_row(row)
        print(
            f"  {model} {name}: ppl {row['perplexity']:.3f} ({row['perplexity_increase_pct']:+.2f}%), final answers "
            f"agree {generation['final_answer_agreement_pct']:.0f}%, accuracy {generation['accuracy_pct']:.0f}%, "
            f"batch-1 {figures['batch1_decode']['decode_tokens_per_s']:.1f} tok/s, batch-{SPEED_BATCH} "
            f"{figures[f'batch{SPEED_BATCH}_decode']['decode_tokens_per_s']:.1f} tok/s "
            f"({row['seconds']:.0f} s)",
            flush=True,
        )
    del checkpoint
    _free()
    return rows


def print_model_table(model: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = []
    for row in rows:
        g = row["generation_vs_float32"]
        table.append([
            row["format"], row["precision"]["kv_cache_dtype"], row["weight_gb"], row["rss_after_load_gb"],
            row["perplexity"], f"{row['perplexity_increase_pct']:+.2f}", row["top1_agreement_with_float32_pct"],
            g["final_answer_agreement_pct"], g["answers_without_number"], g["accuracy_pct"], g["token_agreement_pct"],
            f"{g['token_identical_answers']}/{g['answers']}", row["batch1_decode"]["decode_tokens_per_s"],
            row[f"batch{SPEED_BATCH}_decode"]["decode_tokens_per_s"],
        ])  # fmt: skip
    print_table(
        f"Quality per format against float32: {model}; perplexity on {args.ppl_tokens} GSM8K train tokens; greedy "
        f"answers to {rows[0]['generation_vs_float32']['answers']} "
        f"GSM8K test questions (<= {args.max_tokens} tokens); {args.threads} threads",
        [
            "format",
            "kv",
            "weights GB",
            "RSS GB",
            "ppl",
            "ppl +%",
            "top-1 %",
            "answer agree %",
            "no number",
            "accuracy %",
            "token agree %",
            "identical",
            "b1 tok/s",
            f"b{SPEED_BATCH} tok/s",
        ],
        table,
    )


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "large"], help="demo model names or model paths")
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(FORMATS),
        choices=list(FORMATS),
        help="float32, the reference, is always measured first",
    )
    parser.add_argument("--questions", type=int, default=100, help="GSM8K test questions answered per format")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per answer at most")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="GSM8K train tokens for perplexity")
    parser.add_argument("--speed-tokens", type=int, default=64, help="decode steps timed at batch 1 and batch 16")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: physical cores)")
    parser.add_argument("--data", type=Path, default=GSM8K_DIR, help="directory of GSM8K train.jsonl and test.jsonl")
    args = parser.parse_args(argv)
    args.formats = [REFERENCE, *(f for f in dict.fromkeys(args.formats) if f != REFERENCE)]
    args.threads = args.threads or physical_core_count()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    check_data(args.data)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    done: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:  # after every format, so that an interrupted run keeps what it did
        done.append(row)
        write_figures(args, done, time.perf_counter() - started)

    for model in args.models:
        print_model_table(model, bench_model(model, args, record), args)


def write_figures(args: argparse.Namespace, rows: list[dict[str, Any]], wall_s: float) -> None:
    write_results("quant_quality", {
        "cpu_model": cpu_model(), "threads": args.threads,
        "settings": {
            "models": args.models, "formats": {name: FORMATS[name] for name in args.formats},
            "gsm8k_dir": str(args.data), "questions": args.questions, "max_new_tokens": args.max_tokens,
            "decoding": "greedy, stops at EOS", "max_num_seqs": MAX_NUM_SEQS, "ppl_tokens": args.ppl_tokens,
            "ppl_text": "GSM8K train question + answer, from the first example",
            "speed_decode_steps": args.speed_tokens, "speed_batch": SPEED_BATCH, "kv_cache_mb": args.kv_cache_mb,
        },
        "wall_s": wall_s,
        "results": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
