"""Prompt scoring (loglikelihood) per tier: our engine against transformers' forward pass, as lm-eval scores.

`python -m bench.scoring [--models small large] [--prompts 24] [--hf-batch 8] [--data DIR]`

What `/v1/completions` with `echo` and `logprobs` does for lm-evaluation-harness's `local-completions` (each prompt
token's logprob after the tokens before it), against what lm-eval's own `hf` backend does with the same weights:
a transformers model in float32, `--hf-batch` prompts padded on the right to a forward pass, then log-softmax and
the next tokens' logprobs gathered. Prompts: GSM8K train questions, each with its worked answer (the perplexity
text of `bench.quant_quality`), as token ids.

Per model, in one run:
  ours_scoring   the engine `make run` builds for the tier (`engines.tiers.tier_spec`: quantisation `auto`), every
                 prompt submitted at once with `prompt_logprobs`, `max_tokens` 1: prompt tokens scored per second;
  ours_prefill   the same prompts without scoring (prefix caching off): the prefill alone, so that the cost of
                 scoring (every row through the LM head, log-softmax) shows apart;
  hf_float32     transformers in float32 on the same prompts and threads;
  hf_bfloat16    transformers in bfloat16 (lm-eval's `dtype="auto"` for these checkpoints), only on CPUs with native
                 bfloat16 arithmetic (AVX512_BF16 or AMX): elsewhere PyTorch emulates it, many times slower.
`ours_vs_hf` is against the faster of the two. Beside the speeds: the mean absolute difference between our per-token
logprobs and HF float32's (what the quantised weights shift a loglikelihood by, per token; bfloat16's own shift
beside it) and how often both give the same sum-logprob ranking of two prompts. Writes bench/results/scoring.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_model, print_table, write_results
from bench.engine import GSM8K_DIR, gsm8k_worked_answers, hf_model
from engines.cpu import has_native_bf16
from engines.llm_engine import LLMEngine
from engines.loader import load_checkpoint
from engines.sampling_params import SamplingParams
from engines.tiers import tier_spec


def ours(engine: LLMEngine, prompts: list[list[int]], scored: bool, tag: str) -> tuple[float, list[list[float]]]:
    """Seconds for every prompt at once, and (scoring) each prompt's token logprobs after its first token."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0 if scored else None)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                logprobs[output.request_id] = [lp.logprob for lp in output.prompt_logprobs[1:] if lp is not None]
    seconds = time.perf_counter() - started
    return seconds, [logprobs.get(f"{tag}-{i}", []) for i in range(len(prompts))]


@torch.inference_mode()
def hf_scores(model: Any, prompts: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    """lm-eval's `hf` loglikelihood: right-padded batches, one forward, log-softmax, the next tokens gathered."""
    started = time.perf_counter()
    scores: list[list[float]] = []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(map(len, group))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in group])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
        log_probs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        chosen = log_probs[:, :-1].gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
        scores += [chosen[j, :len(p) - 1].tolist() for j, p in enumerate(group)]
    return time.perf_counter() - started, scores


def agreement(ours_lp: list[list[float]], reference: list[list[float]]) -> dict[str, float]:
    """Per-token |Δ logprob| against the reference, and the share of prompt pairs both rank alike by sum-logprob."""
    deltas = [abs(a - b) for x, y in zip(ours_lp, reference, strict=True) for a, b in zip(x, y, strict=True)]
    sums = [(sum(x), sum(y)) for x, y in zip(ours_lp, reference, strict=True)]
    pairs = list(itertools.combinations(sums, 2))
    same = sum((a[0] > b[0]) == (a[1] > b[1]) for a, b in pairs)
    return {
        "mean_abs_logprob_diff_per_token": sum(deltas) / len(deltas),
        "max_abs_logprob_diff_per_token": max(deltas),
        "pairwise_ranking_agreement": same / len(pairs) if pairs else float("nan"),
    }


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = tier_spec(name, name)
    config = spec.engine_config()
    checkpoint = load_checkpoint(Path(config.model))
    prompts = [checkpoint.tokenizer.encode(text) for text in gsm8k_worked_answers(args.data, 0, args.prompts)]
    num_tokens = sum(len(p) for p in prompts)
    print(f"\n== {name}: {len(prompts)} prompts, {num_tokens} tokens", flush=True)
    engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False))
    ours(engine, prompts[:2], scored=True, tag="warm")
    prefill_s, _ = ours(engine, prompts, scored=False, tag="plain")
    scoring_s, our_logprobs = ours(engine, prompts, scored=True, tag="scored")
    precision = engine.precision()
    del engine
    gc.collect()
    hf: dict[str, tuple[float, list[list[float]]]] = {}
    for dtype in [torch.float32, *([torch.bfloat16] if has_native_bf16() else [])]:
        model = hf_model(checkpoint, dtype)
        hf_scores(model, prompts[:2], args.hf_batch)
        hf[str(dtype).removeprefix("torch.")] = hf_scores(model, prompts, args.hf_batch)
        del model
        gc.collect()
    reference = hf["float32"][1]
    fastest = min(hf, key=lambda dtype: hf[dtype][0])
    return {
        "model": name,
        "precision": precision,
        "prompts": len(prompts),
        "prompt_tokens": num_tokens,
        "ours_scoring_tokens_per_s": num_tokens / scoring_s,
        "ours_prefill_tokens_per_s": num_tokens / prefill_s,
        "scoring_cost_vs_prefill": scoring_s / prefill_s,
        **{f"hf_{dtype}_tokens_per_s": num_tokens / seconds for dtype, (seconds, _) in hf.items()},
        "hf_batch": args.hf_batch,
        "hf_fastest": fastest,
        "ours_vs_hf": hf[fastest][0] / scoring_s,
        **agreement(our_logprobs, reference),
        **{f"hf_{dtype}_vs_float32": agreement(scores, reference) for dtype, (_, scores) in hf.items()
           if dtype != "float32"},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "large"])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--data", type=Path, default=GSM8K_DIR, help="directory of GSM8K train.jsonl")
    args = parser.parse_args(argv)
    if not (args.data / "train.jsonl").exists():
        raise SystemExit(f"GSM8K train.jsonl not found in {args.data}: pass its directory with --data")
    rows = [bench_model(name, args) for name in args.models]
    print_table(
        f"Prompt scoring, tokens/s ({cpu_model()}, {torch.get_num_threads()} threads)",
        ["model", "ours scoring", "ours prefill", "HF float32", "HF bfloat16", "ours / fastest HF", "mean |Δlogprob|",
         "ranking agreement"],
        [[r["model"], r["ours_scoring_tokens_per_s"], r["ours_prefill_tokens_per_s"], r["hf_float32_tokens_per_s"],
          r.get("hf_bfloat16_tokens_per_s", "-"), r["ours_vs_hf"], r["mean_abs_logprob_diff_per_token"],
          r["pairwise_ranking_agreement"]] for r in rows],
    )
    write_results("scoring", {"cpu": cpu_model(), "threads": torch.get_num_threads(), "models": rows})


if __name__ == "__main__":
    main()
