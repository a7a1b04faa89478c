"""Next-token selection for a batch: penalties and logit bias, grammar masks, greedy, temperature,
top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engines.cpu_kernels import logprob_rows, sample_rows
from engines.outputs import TokenLogprob
from engines.sampling_params import SamplingParams
from engines.structured import GrammarState, allocate_bitmask, apply_bitmask

# Part of `system_fingerprint` (`engines.serving.backend_fingerprint`): a seeded request's tokens change with it.
SAMPLER_VERSION = 3  # 2: draws by block inverse CDF (`draw`), top-p among the most likely ids first; 3: one uniform
# variate a draw, the id within its block by inverse CDF too (`inverse_cdf`), kept ids in id order (`draw_kept`), the
# same rule in C (`draw_native`)
# [rows, vocabulary] float32 temporaries of sampling and logprobs stay under the heap's mmap threshold at 32 rows of a
# 152k vocabulary (19 MB; `engines.cpu.keep_freed_memory`): 64 rows (39 MB) were mapped and page-faulted afresh each
# time, 3× the time of the arithmetic (BENCHMARKS.md, prompt scoring).
SAMPLED_ROWS_AT_ONCE = 32
DRAW_BLOCK = 1024
NUCLEUS_CANDIDATES = (8192, 32768)
LIKELY_SHARE = 1e-4


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
    token_ids, known = _choose(adjusted, params, generators)
    if grammars is not None and any(g is not None for g in grammars):
        _constrain(adjusted, token_ids, params, generators, grammars)
        known = {row: logprob for row, logprob in known.items() if grammars[row] is None}
    chosen = token_ids.tolist()
    # The draw's logprobs are those of the logits it drew from: the unmodified ones only where nothing adjusted them.
    return chosen, token_logprobs(logits, chosen, params, known if adjusted is logits else None)


def greedy_only(params: Sequence[SamplingParams], grammars: Sequence[GrammarState | None] | None = None) -> bool:
    """Whether each row's token is its logits' argmax and nothing else is read from them but, where asked, that
    token's own logprob (no penalties, bias, grammar or top logprobs): such a step can take its tokens and their
    logprobs from the LM head's own pass (`ModelRunner.execute(greedy=True)`), what `sample` would give."""
    return bool(params) and not _needs_host(params, grammars) and not any(p.top_logprobs for p in params)


@dataclass(frozen=True)
class GreedyTokens:
    """A greedy step's choice: each row's argmax id, and where the step asks, the log-softmax there."""

    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32, or None


def greedy_tokens(logits: torch.Tensor, with_logprobs: bool = False) -> GreedyTokens:
    """Each row's argmax of `logits` [rows, V] and, with `with_logprobs`, its log-softmax there."""
    token_ids = argmax_ids(logits)
    logprobs = _log_softmax_at(logits, token_ids.tolist(), 0)[0] if with_logprobs else None
    return GreedyTokens(token_ids, logprobs)


def greedy_logprobs(chosen: GreedyTokens, params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """The chosen tokens' logprobs for the rows that ask (`greedy_only`: none asks for top logprobs)."""
    if chosen.logprobs is None:
        return [None] * len(params)
    return _known_logprobs(chosen.token_ids.tolist(), params, dict(enumerate(chosen.logprobs.tolist())))


def _known_logprobs(token_ids: Sequence[int], params: Sequence[SamplingParams],
                    known: Mapping[int, float]) -> list[TokenLogprob | None]:
    """The chosen tokens' logprobs had already (`known`, by row) for the rows that ask for them and no top ones."""
    return [TokenLogprob(token_id=token_ids[i], logprob=known[i], top=[])
            if p.logprobs and not p.top_logprobs and i in known else None for i, p in enumerate(params)]


def _needs_host(params: Sequence[SamplingParams], grammars: Sequence[GrammarState | None] | None) -> bool:
    """Whether a row asks for more than a greedy choice (and its logprobs), which run wherever the logits are."""
    constrained = grammars is not None and any(grammar is not None for grammar in grammars)
    return constrained or any(not p.greedy or p.penalised or p.logit_bias or p.min_tokens for p in params)


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  output_token_ids: Sequence[Sequence[int]] | None,
                  seen_token_ids: Sequence[Sequence[int]] | None = None,
                  eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The penalties, logit bias and `min_tokens`, on the rows that ask for them and, in a row, on the ids they
    concern (the distinct ids seen or generated, not the whole vocabulary); returns `logits` itself when no row
    asks, else a modified copy.

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
    # Only the ids a row has seen or generated change: a few hundred of a 152k vocabulary.
    for i in repeated if seen_token_ids is not None else []:
        tokens = _distinct(seen_token_ids[i], vocab)[0]  # type: ignore[index]
        picked, penalty = logits[i, tokens], params[i].repetition_penalty
        logits[i, tokens] = torch.where(picked > 0, picked / penalty, picked * penalty)
    for i in penalised if output_token_ids is not None else []:
        tokens, counts = _distinct(output_token_ids[i], vocab)  # type: ignore[index]
        logits[i, tokens] -= params[i].frequency_penalty * counts + params[i].presence_penalty
    if biased:
        entries = [(i, token, bias) for i in biased for token, bias in params[i].logit_bias.items() if token < vocab]
        if entries:
            rows_t, tokens_t, values_t = (torch.tensor(column) for column in zip(*entries, strict=True))
            logits.index_put_((rows_t, tokens_t), values_t.to(logits.dtype), accumulate=True)
    for i in unended:
        ends = {*params[i].stop_token_ids, *(() if params[i].ignore_eos else eos_token_ids)}
        logits[i, [t for t in ends if t < vocab]] = float("-inf")
    return logits


def _distinct(token_ids: Sequence[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids below `vocab` among `token_ids`, and how often each occurs."""
    tokens, counts = np.unique(np.asarray(token_ids, dtype=np.int64), return_counts=True)
    kept = tokens < vocab
    return torch.from_numpy(tokens[kept]), torch.from_numpy(counts[kept].astype(np.float32))


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: the same ids (the first of equal maxima; NaN counts as the maximum). Float32
    logits on the CPU go through numpy, whose argmax is vectorised; torch's CPU argmax is not, and over a 152k-token
    vocabulary it was a tenth of a 32-row decode step (BENCHMARKS.md, 2026-12-06)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def _choose(logits: torch.Tensor, params: Sequence[SamplingParams],
            generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, dict[int, float]]:
    """Each row's token, and the log-softmax of `logits` at it for the rows whose draw gave it (`draw_native`)."""
    token_ids = torch.zeros(len(params), dtype=torch.long)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        token_ids[greedy_rows] = argmax_ids(take_rows(logits, greedy_rows))
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    uniforms = {row: _uniform(generators[row]) for row in random_rows}
    native = draw_native(logits, random_rows, params, uniforms)
    drawn = {row: token for row, (token, _) in native.items()}
    known = {row: logprob for row, (_, logprob) in native.items() if not math.isnan(logprob)}
    rest = [row for row in random_rows if row not in drawn]
    for start in range(0, len(rest), SAMPLED_ROWS_AT_ONCE):
        rows = rest[start:start + SAMPLED_ROWS_AT_ONCE]
        for row, (weights, ids) in zip(rows, candidates(take_rows(logits, rows), [params[i] for i in rows]),
                                       strict=True):
            drawn[row] = draw_kept(weights, ids, uniforms[row])
    if drawn:
        token_ids[list(drawn)] = torch.tensor(list(drawn.values()))
    return token_ids, known


def draw_kept(weights: torch.Tensor, ids: torch.Tensor | None, u: float) -> int:
    """The id `inverse_cdf` picks at `u` from one of `candidates`' rows, the kept ids taken in id order (whatever
    order they came in), as `draw_native` takes them."""
    if ids is None:
        return inverse_cdf(weights, u)
    ids, order = ids.sort()
    return int(ids[inverse_cdf(weights[order], u)])


def draw_native(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                uniforms: dict[int, float]) -> dict[int, tuple[int, float]]:
    """The draws of `rows` by the CPU kernel (`engines.cpu_kernels.sample_rows`), each the id `draw_kept` picks at
    the row's variate from `candidates`' distribution: the ids min-p, top-k and top-p keep, found among the row's
    likely ids (or, for a nucleus beyond them, from a histogram of its mass), and the draw in id order, in two or
    three passes over a row where PyTorch makes six or more. Rows the kernel leaves (what they keep not found among
    `NUCLEUS_CANDIDATES[0]` ids), and every row where it cannot run, are not in the result. Beside each id its
    log-softmax where the draw summed the whole row (temperature 1, no min-p; `token_logprobs`' value), else NaN."""
    vocab = logits.shape[-1]
    kernel = sample_rows()
    if kernel is None or not rows or not kernel.supports(logits):
        return {}
    ids, logprobs = kernel(take_rows(logits, rows), [params[row].temperature for row in rows],
                           [params[row].top_k if 0 < params[row].top_k < vocab else 0 for row in rows],
                           [params[row].top_p for row in rows], [params[row].min_p for row in rows],
                           [uniforms[row] for row in rows], math.log(LIKELY_SHARE), NUCLEUS_CANDIDATES[0])
    return {row: (token, logprob) for row, token, logprob in zip(rows, ids, logprobs, strict=True) if token >= 0}


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id drawn from a row of non-negative `weights` (not necessarily normalised): `inverse_cdf` at a uniform
    variate from `generator`."""
    return inverse_cdf(weights, _uniform(generator))


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The id at which the cumulative sum of `weights` (non-negative, not necessarily normalised) first exceeds
    u · their total, u in [0, 1): the block of `DRAW_BLOCK` ids by the blocks' cumulative masses in float64, then the
    id within it by its ids'. With u uniform that is a draw from `weights` that reads the row once, where
    `torch.multinomial` draws an exponential variate for every id (~3 ms a row at a 152k vocabulary). An id of
    weight 0 is never chosen."""
    num_ids = weights.shape[-1]
    whole = num_ids - num_ids % DRAW_BLOCK
    masses = weights[:whole].reshape(-1, DRAW_BLOCK).sum(dim=1, dtype=torch.float64)
    if whole < num_ids:
        masses = torch.cat([masses, weights[whole:].sum(dtype=torch.float64).reshape(1)])
    cdf = masses.cumsum(0)
    target = u * float(cdf[-1])
    block = int(torch.searchsorted(cdf, target, right=True))
    block = min(block, int(masses.nonzero()[-1]))  # u · total may round up to the total
    start = block * DRAW_BLOCK
    within = weights[start:start + DRAW_BLOCK]
    residual = target - (float(cdf[block - 1]) if block else 0.0)
    index = int(torch.searchsorted(within.to(torch.float64).cumsum(0), residual, right=True))
    return start + min(index, int(within.nonzero()[-1]))


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
    token_ids[index] = _choose(masked, [params[i] for i in redo], [generators[i] for i in redo])[0]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], params: Sequence[SamplingParams],
                   known: Mapping[int, float] | None = None) -> list[TokenLogprob | None]:
    """Each row's chosen token's logprob (and the top ones) under the unmodified distribution, for rows that ask;
    `SAMPLED_ROWS_AT_ONCE` rows at a time (a scored prompt chunk brings hundreds). `known`: chosen tokens' logprobs
    had already (from the draw), taken for rows that ask for no top ones."""
    logprobs = _known_logprobs(token_ids, params, known or {})
    wanted = [i for i, p in enumerate(params) if p.logprobs and logprobs[i] is None]
    for start in range(0, len(wanted), SAMPLED_ROWS_AT_ONCE):
        rows = wanted[start:start + SAMPLED_ROWS_AT_ONCE]
        num_top = max(params[i].top_logprobs for i in rows)
        chosen_lp, top_ids, top_values = _log_softmax_at(take_rows(logits, rows), [token_ids[i] for i in rows],
                                                         num_top)
        for j, (row, logprob) in enumerate(zip(rows, chosen_lp.tolist(), strict=True)):
            k = params[row].top_logprobs
            top = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist(), strict=True))
            logprobs[row] = TokenLogprob(token_id=token_ids[row], logprob=logprob, top=top)
    return logprobs


def _log_softmax_at(logits: torch.Tensor, chosen: list[int], num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rows' log-softmax at `chosen` [rows] and at their `num_top` most likely ids ([rows, num_top] ids and
    values): the CPU kernel (`engines.cpu_kernels.logprob_rows`: two passes over a row, nothing written), else a
    log-softmax and `topk`."""
    kernel = logprob_rows()
    if kernel is not None and kernel.supports(logits):
        return kernel(logits, chosen, num_top)
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen_lp = log_probs.gather(1, torch.tensor(chosen, device=logits.device).unsqueeze(1)).squeeze(1)
    top_values, top_ids = log_probs.topk(num_top, dim=-1)
    return chosen_lp, top_ids, top_values


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax after temperature, min-p, top-k and top-p (rows: random
    params)."""
    probs = torch.zeros_like(logits)
    for row, (weights, ids) in enumerate(candidates(logits, params)):
        if ids is None:
            probs[row] = weights
        else:
            probs[row, ids] = weights
    return probs


Candidates = tuple[torch.Tensor, torch.Tensor | None]  # probabilities, and the ids they belong to (None: every id)


def candidates(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[Candidates]:
    """Each row's distribution after temperature, min-p, top-k and top-p, as (probabilities, the ids they belong to):
    over the whole vocabulary (ids None), or over the few ids top-k / top-p keep, which a draw then reads alone."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperatures
    min_ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype).unsqueeze(1)
    if (min_ps > 0).any():  # vLLM's min_p, on the tempered distribution: relative to its most likely token
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    vocab = logits.shape[-1]
    top_ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_ps = torch.tensor([p.top_p for p in params])
    truncates = (top_ks < vocab) | (top_ps < 1.0)
    result: dict[int, Candidates] = {}
    if truncates.any():
        rows = truncates.nonzero().squeeze(1)
        for row, (values, ids) in zip(rows.tolist(), top_k_top_p(take_rows(logits, rows), top_ks[rows], top_ps[rows]),
                                      strict=True):
            result[row] = (values.softmax(dim=-1), ids)
    if not truncates.all():
        rows = (~truncates).nonzero().squeeze(1)
        for row, probs in zip(rows.tolist(), take_rows(logits, rows).softmax(dim=-1), strict=True):
            result[row] = (probs, None)
    return [result[row] for row in range(len(params))]


def top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Each row's logits and ids that its top k, then the smallest prefix of those whose mass reaches top p, keep (most
    likely first). Top-k rows take their k most likely ids (`topk`). Top-p rows without top-k look among their likely
    ids first (`_likely_ids`: a comparison and a gather for all of them); then the prefix is looked for among the most
    likely `NUCLEUS_CANDIDATES` ids (`topk` of 8192 takes ~1 ms at a 152k vocabulary), then among more, and a row is
    sorted whole (~12 ms) only when its prefix is not among those."""
    vocab = logits.shape[-1]
    top_p_only = top_ks == vocab
    # A top-p row's candidates are normalised by its whole row's logsumexp; a top-k row's by their own (`_nucleus`).
    normaliser = logits.logsumexp(dim=-1) if top_p_only.any() else torch.zeros(len(logits), dtype=logits.dtype)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pending = torch.arange(len(logits))
    if top_p_only.any():
        rows = top_p_only.nonzero().squeeze(1)
        values, ids, too_many = _likely_ids(take_rows(logits, rows))
        values, complete = _nucleus(values, top_ks[rows], top_ps[rows], normaliser[rows])
        _keep(kept, rows, values, ids, complete & ~too_many)
        pending = torch.tensor([row for row in range(len(logits)) if row not in kept], dtype=torch.long)
    if (top_ks < vocab).any():  # a top-k row's kept ids are among its k most likely
        rows = (top_ks < vocab).nonzero().squeeze(1)
        values, ids = take_rows(logits, rows).topk(int(top_ks[rows].max()), dim=-1)
        values, _ = _nucleus(values, top_ks[rows], top_ps[rows], normaliser[rows])
        _keep(kept, rows, values, ids, torch.ones(len(rows), dtype=torch.bool))
        pending = pending[top_ks[pending] == vocab]
    for width in sorted({min(vocab, candidates) for candidates in (*NUCLEUS_CANDIDATES, vocab)}):
        if not len(pending):
            break
        rows = take_rows(logits, pending)
        values, ids = rows.sort(dim=-1, descending=True) if width == vocab else rows.topk(width, dim=-1)
        values, complete = _nucleus(values, top_ks[pending], top_ps[pending], normaliser[pending])
        _keep(kept, pending, values, ids, complete)  # every row is complete once sorted whole
        pending = pending[~complete]
    return [kept[row] for row in range(len(logits))]


def take_rows(tensor: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """`tensor[rows]` for ascending, distinct `rows`: a view, not a copy of [rows, vocabulary], when they are
    consecutive (most often: every row of the step)."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return tensor[rows[0]:rows[-1] + 1]
    return tensor[torch.tensor(rows, dtype=torch.long)]


def _keep(kept: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, values: torch.Tensor,
          ids: torch.Tensor, complete: torch.Tensor) -> None:
    """Record the complete rows' kept logits and ids: the finite prefix of their values."""
    lengths = values.isfinite().sum(dim=-1).tolist()
    for i in complete.nonzero().squeeze(1).tolist():
        kept[int(rows[i])] = (values[i, :lengths[i]], ids[i, :lengths[i]])


def _likely_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ids at least `LIKELY_SHARE` as likely as its most likely one (in a model's distributions a few
    hundred, which hold the nucleus), as their logits in descending order and the ids, padded with -inf; and the rows
    that have too many such ids to sort cheaply (left empty here)."""
    mask = logits >= logits.max(dim=-1, keepdim=True).values + math.log(LIKELY_SHARE)
    counts = mask.sum(dim=-1)
    too_many = counts > NUCLEUS_CANDIDATES[0]
    if too_many.any():
        mask[too_many] = False
        counts = torch.where(too_many, 0, counts)
    rows, ids = mask.nonzero(as_tuple=True)  # row by row, ids ascending
    position = torch.arange(len(ids)) - (counts.cumsum(0) - counts)[rows]
    width = max(1, int(counts.max()))
    values = torch.full((len(logits), width), float("-inf"), dtype=logits.dtype)
    values[rows, position] = logits[rows, ids]
    id_matrix = torch.zeros((len(logits), width), dtype=torch.long)
    id_matrix[rows, position] = ids
    values, order = values.sort(dim=-1, descending=True)
    return values, id_matrix.gather(1, order), too_many


def _nucleus(values: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
             normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On each row's most likely logits in descending order (the first `width` of the row, whose logsumexp is
    `normaliser`): those outside the top k and the top p set to -inf, and whether the row's kept set is certain from
    these alone (its top k within them, or its mass reached p within them)."""
    width = values.shape[-1]
    values = values.masked_fill(torch.arange(width).unsqueeze(0) >= top_ks.unsqueeze(1), float("-inf"))
    within = top_ks <= width  # the top k is among the values: they hold its whole mass
    normaliser = torch.where(within, values.logsumexp(dim=-1), normaliser)
    probs = (values - normaliser.unsqueeze(1)).exp()
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    # The most likely token always stays (top_p 0 samples it alone, as OpenAI does).
    drop = probs.cumsum(dim=-1) - probs >= top_ps.unsqueeze(1)
    drop[:, 0] = False
    return values.masked_fill(drop, float("-inf")), within | drop.any(dim=-1)
