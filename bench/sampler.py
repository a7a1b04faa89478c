"""Sampling per decode step: our sampler against sorting whole rows and drawing with `torch.multinomial`.

`python -m bench.sampler [--model small] [--batch-sizes 1 8 32 64] [--decode-batch-sizes 1 16] [--data DIR]
[--without-amx]`

Part 1, the sampler alone: one `engines.sampler.sample` call over B rows of real next-token logits (the tier's model
over GSM8K train text, prefilled through its engine as `make run` builds it: each row a position of that text), per
setting — OpenAI's default (temperature 1), temperature 0.7 with top_p 0.95, top_k 50 with top_p 0.9, temperature 1.3
with top_p 0.99 — against the baseline in this file: the same filters by sorting each whole row and a draw by
`torch.multinomial` over it, which races an exponential variate per id (vLLM's CPU sampler draws the same way; ours
did both before 2026-12-07).
Part 2, what a user sees: the tier's decode tokens/s at each of `--decode-batch-sizes` concurrent requests, sampled
(temperature 1, top_p 0.95) against greedy in the same run, and each with the chosen tokens' logprobs (what the
cascade asks the small tier for). Between them, penalties (frequency and presence, or
repetition; 300 generated and 800 seen ids a row) in one call against applying them densely over the vocabulary, and
logprobs (the chosen tokens', and the top 5) against a log-softmax of the whole rows and `topk`.
Writes bench/results/sampler.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, print_table, run_without_amx, write_results
from bench.engine import GSM8K_DIR, gsm8k_worked_answers, token_stream
from engines.llm_engine import LLMEngine
from engines.model_runner import TokenSpan
from engines.sampler import argmax_ids, sample
from engines.sampling_params import SamplingParams
from engines.tiers import tier_spec

SETTINGS = {
    "temperature 1 (default)": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "top_k 50, top_p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    # High-entropy rows: most nuclei reach past the ids 10⁻⁴ as likely as the top one.
    "temperature 1.3, top_p 0.99": SamplingParams(temperature=1.3, top_p=0.99),
}
DECODE_TOKENS = 48
LOGPROBS = {
    "logprobs": SamplingParams(temperature=0.0, logprobs=True),
    "logprobs, top_logprobs 5": SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
    # The cascade's small-tier request at OpenAI's default temperature: the draw's own sum gives the logprob
    "temperature 1, logprobs": SamplingParams(temperature=1.0, logprobs=True),
}
PENALTIES = {
    "frequency 0.5, presence 0.3": SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
    "repetition 1.1": SamplingParams(temperature=0.0, repetition_penalty=1.1),
}


def sort_and_multinomial(logits: torch.Tensor, params: list[SamplingParams],
                         generators: list[torch.Generator | None]) -> list[int]:
    """The baseline: temperature, then top-k and top-p (where asked) by sorting each whole row, then
    `torch.multinomial` per row."""
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    vocab = logits.shape[-1]
    if all(p.top_k in (0, -1) and p.top_p == 1.0 for p in params):
        probs = logits.softmax(dim=-1)
        return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, generators, strict=True)]
    values, ids = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)
    values = values.masked_fill(torch.arange(vocab).unsqueeze(0) >= ks, float("-inf"))
    probs = values.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= torch.tensor([p.top_p for p in params]).unsqueeze(1)
    drop[:, 0] = False
    probs = torch.full_like(logits, float("-inf")).scatter(1, ids, values.masked_fill(drop, float("-inf")))
    probs = probs.softmax(dim=-1)
    return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, generators, strict=True)]


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams], generated: list[list[int]],
                    seen: list[list[int]]) -> torch.Tensor:
    """The baseline for penalties: per row, over the whole vocabulary (a seen-mask and a count per id), as ours did
    before 2026-12-07."""
    logits, vocab = logits.clone(), logits.shape[-1]
    mask = torch.zeros(len(params), vocab, dtype=torch.bool)
    for row, ids in enumerate(seen):
        mask[row, torch.tensor(ids)] = True
    penalty = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    logits = torch.where(mask, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    counts = torch.zeros(len(params), vocab).scatter_add_(1, torch.tensor(generated), torch.ones(len(params),
                                                                                                 len(generated[0])))
    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    return logits - frequency * counts - presence * (counts > 0)


def real_logits(engine: LLMEngine, data: Path, rows: int) -> torch.Tensor:
    """`rows` next-token logit rows of the tier's model over GSM8K train text (the engine's cache blocks reused)."""
    token_ids = token_stream(engine.tokenizer, gsm8k_worked_answers(data, 0, 64), rows + 1)[:rows + 1]
    runner, chunks = engine.runner, []
    for start in range(0, rows, 256):
        chunk = token_ids[start:start + 256]
        blocks = list(range(-(-len(chunk) // runner.block_size)))
        chunks.append(runner.forward([TokenSpan(chunk, 0, blocks, "all")]))
    return torch.cat(chunks)[:rows]


def time_call(call: Any, repeats: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e3


Calls = tuple[Callable[[], Any], Callable[[], Any]]  # ours, the baseline


def against_baseline(settings: dict[str, SamplingParams], batch_sizes: list[int],
                     calls: Callable[[SamplingParams, int], Calls], baseline_key: str) -> list[dict[str, Any]]:
    """Per setting and batch size, one call of ours and one of the baseline (`calls(params, size)`), ms each."""
    rows = []
    for name, params in settings.items():
        for size in batch_sizes:
            ours, baseline = calls(params, size)
            repeats = max(3, 64 // size)
            ours_ms, baseline_ms = time_call(ours, repeats), time_call(baseline, repeats)
            rows.append({"setting": name, "batch_size": size, "ours_ms": ours_ms, baseline_key: baseline_ms,
                         "speedup": baseline_ms / ours_ms})
    return rows


def sampler_alone(logits: torch.Tensor, batch_sizes: list[int]) -> list[dict[str, Any]]:
    def calls(params: SamplingParams, size: int) -> Calls:
        batch, generators = logits[:size], [torch.Generator().manual_seed(i) for i in range(size)]
        return (lambda: sample(batch, [params] * size, generators),
                lambda: sort_and_multinomial(batch, [params] * size, generators))

    return against_baseline(SETTINGS, batch_sizes, calls, "sort_and_multinomial_ms")


def penalties_alone(logits: torch.Tensor, batch_sizes: list[int]) -> list[dict[str, Any]]:
    """`sample` with penalties (greedy, 300 generated and 800 seen ids a row) against the dense baseline + argmax."""
    argmaxes = [int(t) for t in logits.argmax(dim=-1).tolist()]
    history = argmaxes * -(-(max(batch_sizes) + 800) // len(argmaxes))  # long enough for every row's 800 ids

    def calls(params: SamplingParams, size: int) -> Calls:
        batch = logits[:size]
        generated = [history[i:i + 300] for i in range(size)]
        seen = [history[i:i + 800] for i in range(size)]
        return (lambda: sample(batch, [params] * size, [None] * size, generated, None, seen),
                lambda: dense_penalties(batch, [params] * size, generated, seen).argmax(dim=-1))

    return against_baseline(PENALTIES, batch_sizes, calls, "dense_penalties_ms")


def log_softmax_and_topk(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[float], list[Any]]:
    """The baseline for logprobs: the choice (ours: `argmax_ids`, or `sample` without logprobs), then the whole rows'
    log-softmax, the chosen ids' values gathered and `topk` of the top logprobs, as ours did before 2026-12-07."""
    if all(p.greedy for p in params):
        chosen = argmax_ids(logits)
    else:
        plain = [dataclasses.replace(p, logprobs=False, top_logprobs=0) for p in params]
        chosen = torch.tensor(sample(logits, plain, [None] * len(params))[0])
    log_probs = torch.log_softmax(logits, dim=-1)
    top = log_probs.topk(max(p.top_logprobs for p in params), dim=-1)
    return log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist(), [top.values.tolist(), top.indices.tolist()]


def logprobs_alone(logits: torch.Tensor, batch_sizes: list[int]) -> list[dict[str, Any]]:
    """`sample` with logprobs (the cascade asks the small tier for the chosen tokens', greedy or at temperature 1;
    clients often for the top 5 too) against the log-softmax baseline."""
    def calls(params: SamplingParams, size: int) -> Calls:
        batch = logits[:size]
        return (lambda: sample(batch, [params] * size, [None] * size),
                lambda: log_softmax_and_topk(batch, [params] * size))

    return against_baseline(LOGPROBS, batch_sizes, calls, "log_softmax_and_topk_ms")


def decode_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefill first: the figure is decode alone
    started, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(output.new_token_ids) for output in engine.step())
    return generated / (time.perf_counter() - started)


def decode(engine: LLMEngine, data: Path, batch_sizes: list[int]) -> list[dict[str, Any]]:
    prompts = [engine.tokenizer.encode(text)[:64] for text in gsm8k_worked_answers(data, 100, max(batch_sizes))]
    sampled = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=DECODE_TOKENS, ignore_eos=True, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    # What the cascade asks the small tier for: the tokens with their own logprobs (its confidence)
    greedy_logprobs = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, logprobs=True)
    sampled_logprobs = dataclasses.replace(sampled, logprobs=True)
    rows = []
    for size in batch_sizes:
        figures = {name: decode_tokens_per_s(engine, prompts[:size], params, f"{name}{size}")
                   for name, params in (("greedy", greedy), ("sampled", sampled),
                                        ("greedy_logprobs", greedy_logprobs), ("sampled_logprobs", sampled_logprobs))}
        rows.append({"batch_size": size, "greedy_tokens_per_s": figures["greedy"],
                     "sampled_tokens_per_s": figures["sampled"], "sampled_vs_greedy": figures["sampled"] /
                     figures["greedy"], "greedy_logprobs_tokens_per_s": figures["greedy_logprobs"],
                     "greedy_logprobs_vs_greedy": figures["greedy_logprobs"] / figures["greedy"],
                     "sampled_logprobs_tokens_per_s": figures["sampled_logprobs"],
                     "sampled_logprobs_vs_sampled": figures["sampled_logprobs"] / figures["sampled"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--data", type=Path, default=GSM8K_DIR, help="directory of GSM8K train.jsonl")
    parser.add_argument("--without-amx", action="store_true",
                        help="build w8a8 layers and attention as on a CPU without AMX (VNNI, vdpbf16ps), on a CPU "
                             "that has it")
    args = parser.parse_args(argv)
    if not (args.data / "train.jsonl").exists():
        raise SystemExit(f"GSM8K train.jsonl not found in {args.data}: pass its directory with --data")
    if args.without_amx:
        run_without_amx()
    engine = LLMEngine(tier_spec(args.model, args.model).engine_config())
    logits = real_logits(engine, args.data, max(args.batch_sizes))
    alone = sampler_alone(logits, args.batch_sizes)
    print_table(f"One sample() call, ms ({args.model}, {cpu_model()})",
                ["setting", "batch", "ours", "sort + multinomial", "speedup"],
                [[r["setting"], r["batch_size"], r["ours_ms"], r["sort_and_multinomial_ms"], r["speedup"]]
                 for r in alone])
    penalties = penalties_alone(logits, args.batch_sizes)
    print_table(f"Penalties in one sample() call, ms ({args.model}, {cpu_model()})",
                ["setting", "batch", "ours", "dense over the vocabulary", "speedup"],
                [[r["setting"], r["batch_size"], r["ours_ms"], r["dense_penalties_ms"], r["speedup"]]
                 for r in penalties])
    logprobs = logprobs_alone(logits, args.batch_sizes)
    print_table(f"Logprobs in one sample() call, ms ({args.model}, {cpu_model()})",
                ["setting", "batch", "ours", "log-softmax + topk", "speedup"],
                [[r["setting"], r["batch_size"], r["ours_ms"], r["log_softmax_and_topk_ms"], r["speedup"]]
                 for r in logprobs])
    decoded = decode(engine, args.data, args.decode_batch_sizes)
    print_table(f"Decode tokens/s: sampled (temperature 1 + top_p 0.95) against greedy, and each with the chosen "
                f"tokens' logprobs ({args.model}, {cpu_model()})",
                ["batch", "greedy", "sampled", "sampled / greedy", "greedy + logprobs", "/ greedy",
                 "sampled + logprobs", "/ sampled"],
                [[r["batch_size"], r["greedy_tokens_per_s"], r["sampled_tokens_per_s"], r["sampled_vs_greedy"],
                  r["greedy_logprobs_tokens_per_s"], r["greedy_logprobs_vs_greedy"], r["sampled_logprobs_tokens_per_s"],
                  r["sampled_logprobs_vs_sampled"]] for r in decoded])
    write_results("sampler", {"cpu": cpu_model(), "model": args.model, "precision": engine.precision(),
                              "without_amx": args.without_amx,
                              "sampler_alone": alone, "penalties": penalties, "logprobs": logprobs,
                              "decode": decoded})


if __name__ == "__main__":
    main()
