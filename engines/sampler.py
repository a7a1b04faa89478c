"""Next-token selection for a batch: penalties and logit bias, grammar masks, greedy, temperature,
top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from engines.outputs import TokenLogprob
from engines.sampling_params import SamplingParams
from engines.structured import GrammarState, allocate_bitmask, apply_bitmask


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           output_token_ids: Sequence[Sequence[int]] | None = None,
           grammars: Sequence[GrammarState | None] | None = None,
           seen_token_ids: Sequence[Sequence[int]] | None = None,
           eos_token_ids: Collection[int] = (),
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of `logits` [B, V] (float32).

    `output_token_ids` (what each row generated so far) feeds the penalties and `min_tokens` (which keeps
    `eos_token_ids` and the row's stop tokens out until then), `seen_token_ids` (its prompt and those) the
    repetition penalty; `grammars` constrain their rows. Random rows draw from their own generator, so a seeded
    request samples the same tokens whatever else is in the batch. Logprobs always come from the unmodified
    distribution (before penalties, bias, `min_tokens`, grammar, temperature, top-k and top-p), as OpenAI reports
    them.
    """
    if logits.device.type != "cpu" and _needs_host(params, grammars):
        logits = logits.cpu()  # penalties, bias, grammars and seeded draws work on the host (generators live there)
    adjusted = adjust_logits(logits, params, output_token_ids, seen_token_ids, eos_token_ids)
    token_ids = _choose(adjusted, params, generators)
    if grammars is not None and any(g is not None for g in grammars):
        _constrain(adjusted, token_ids, params, generators, grammars)
    chosen = token_ids.tolist()
    return chosen, token_logprobs(logits, chosen, params)


def greedy_only(params: Sequence[SamplingParams], grammars: Sequence[GrammarState | None] | None = None) -> bool:
    """Whether each row's token is its logits' argmax and nothing else is read from them (no penalties, bias,
    grammar or logprobs): such a step can take its tokens from the LM head's own argmax
    (`ModelRunner.execute(greedy=True)`), the ids `sample` would choose."""
    return bool(params) and not _needs_host(params, grammars) and not any(p.logprobs for p in params)


def _needs_host(params: Sequence[SamplingParams], grammars: Sequence[GrammarState | None] | None) -> bool:
    """Whether a row asks for more than a greedy choice (and its logprobs), which run wherever the logits are."""
    constrained = grammars is not None and any(grammar is not None for grammar in grammars)
    return constrained or any(not p.greedy or p.penalised or p.logit_bias or p.min_tokens for p in params)


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  output_token_ids: Sequence[Sequence[int]] | None,
                  seen_token_ids: Sequence[Sequence[int]] | None = None,
                  eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The penalties, logit bias and `min_tokens`, vectorised over the rows that ask for them; returns `logits`
    itself when no row does, else a modified copy.

    First vLLM's repetition penalty over every token seen (prompt and answer): logit[t] /= p where positive, *= p
    where not. Then OpenAI's: logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0),
    counting the tokens the request generated so far (not its prompt, as vLLM and OpenAI do); then
    logit[t] += bias[t]. Last, a row with fewer than `min_tokens` output tokens cannot end (vLLM's rule): its
    stop tokens and, unless it ignores EOS, `eos_token_ids` are masked.
    """
    unended = ([i for i, p in enumerate(params) if p.min_tokens > len(output_token_ids[i])]
               if output_token_ids is not None else [])
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0] if seen_token_ids is not None else []
    penalised = ([i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
                 if output_token_ids is not None else [])
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not repeated and not penalised and not biased and not unended:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if repeated and seen_token_ids is not None:
        seen = torch.zeros(len(repeated), vocab, dtype=torch.bool)
        for row, i in enumerate(repeated):
            seen[row, torch.tensor([t for t in set(seen_token_ids[i]) if t < vocab], dtype=torch.long)] = True
        penalty = torch.tensor([params[i].repetition_penalty for i in repeated], dtype=logits.dtype).unsqueeze(1)
        rows = torch.tensor(repeated)
        picked = logits[rows]
        logits[rows] = torch.where(seen, torch.where(picked > 0, picked / penalty, picked * penalty), picked)
    if penalised and output_token_ids is not None and (longest := max(len(output_token_ids[i]) for i in penalised)):
        # Pad with an extra column `vocab` that is counted and dropped.
        ids = torch.tensor([list(output_token_ids[i]) + [vocab] * (longest - len(output_token_ids[i]))
                            for i in penalised])
        counts = torch.zeros(len(penalised), vocab + 1).scatter_add_(1, ids, torch.ones(ids.shape))[:, :vocab]
        frequency = torch.tensor([params[i].frequency_penalty for i in penalised]).unsqueeze(1)
        presence = torch.tensor([params[i].presence_penalty for i in penalised]).unsqueeze(1)
        rows = torch.tensor(penalised)
        logits[rows] -= frequency * counts + presence * (counts > 0)
    if biased:
        entries = [(i, token, bias) for i in biased for token, bias in params[i].logit_bias.items() if token < vocab]
        if entries:
            rows_t, tokens_t, values_t = (torch.tensor(column) for column in zip(*entries, strict=True))
            logits.index_put_((rows_t, tokens_t), values_t.to(logits.dtype), accumulate=True)
    for i in unended:
        ends = {*params[i].stop_token_ids, *(() if params[i].ignore_eos else eos_token_ids)}
        logits[i, [t for t in ends if t < vocab]] = float("-inf")
    return logits


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: the same ids (the first of equal maxima; NaN counts as the maximum). Float32
    logits on the CPU go through numpy, whose argmax is vectorised; torch's CPU argmax is not, and over a 152k-token
    vocabulary it was a tenth of a 32-row decode step (BENCHMARKS.md, 2026-12-06)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def _choose(logits: torch.Tensor, params: Sequence[SamplingParams],
            generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    token_ids = argmax_ids(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
        for row, row_probs in zip(random_rows, probs, strict=True):
            token_ids[row] = torch.multinomial(row_probs, 1, generator=generators[row])[0]
    return token_ids


def _constrain(logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None], grammars: Sequence[GrammarState | None]) -> None:
    """Replace, in `token_ids`, each constrained row's choice by one its grammar allows.

    A vocabulary-wide mask costs a walk of the grammar over every token (~0.3 ms a row on a 152k
    vocabulary) where asking the grammar about one token costs ~1 µs, so a row whose unconstrained
    choice the grammar allows keeps it: for greedy rows that is the masked argmax, and for plain
    sampling a draw from p kept when allowed, else redrawn from p masked, is a draw from p masked
    (up to forced text, where the mask would keep only the canonical tokenization). Only the refused
    rows, and rows with top-k or top-p (those filters depend on the mask), are masked and chosen again.
    """
    chosen = token_ids.tolist()
    redo = [row for row, grammar in enumerate(grammars) if grammar is not None and (
        params[row].top_k or params[row].top_p < 1.0 or params[row].min_p or not grammar.allows(chosen[row]))]
    if not redo:
        return
    bitmask = allocate_bitmask(len(redo), logits.shape[-1])
    for i, row in enumerate(redo):
        grammars[row].fill(bitmask, i)  # type: ignore[union-attr]
    index = torch.tensor(redo)
    masked = logits[index]
    apply_bitmask(masked, bitmask)
    token_ids[index] = _choose(masked, [params[i] for i in redo], [generators[i] for i in redo])


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """Each row's chosen token's logprob (and the top ones) under the unmodified distribution, for rows that ask."""
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return logprobs
    # Every row asks when a prompt is scored: no gathered copy of the rows then.
    log_probs = torch.log_softmax(logits if len(wanted) == len(params) else logits[torch.tensor(wanted)], dim=-1)
    chosen = torch.tensor([token_ids[i] for i in wanted], device=logits.device)
    chosen_lp = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    num_top = max(params[i].top_logprobs for i in wanted)
    top_values, top_ids = log_probs.topk(num_top, dim=-1) if num_top else (None, None)
    for j, row in enumerate(wanted):
        top: list[tuple[int, float]] = []
        if top_ids is not None and top_values is not None:
            k = params[row].top_logprobs
            top = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist(), strict=True))
        logprobs[row] = TokenLogprob(token_id=token_ids[row], logprob=chosen_lp[j], top=top)
    return logprobs


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax after temperature, min-p, top-k and top-p (rows: random
    params)."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperatures
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype).unsqueeze(1)
    if (min_ps > 0).any():  # vLLM's min_p, on the tempered distribution: relative to its most likely token
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        # The most likely token always stays (top_p 0 samples it alone, as OpenAI does).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= torch.tensor(top_ps).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
    return logits.softmax(dim=-1)
