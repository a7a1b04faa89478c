"""Next-token selection for a batch: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from engines.outputs import TokenLogprob
from engines.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of `logits` [B, V] (float32).

    Random rows draw from their own generator, so a seeded request samples the same tokens
    whatever else is in the batch. Logprobs always come from the unmodified distribution
    (before temperature, top-k and top-p), as OpenAI reports them.
    """
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
        for row, row_probs in zip(random_rows, probs, strict=True):
            token_ids[row] = torch.multinomial(row_probs, 1, generator=generators[row])[0]
    chosen = token_ids.tolist()
    return chosen, token_logprobs(logits, chosen, params)


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Each row's chosen token's logprob (and the top ones) under the unmodified distribution, for rows that ask."""
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return logprobs
    rows = torch.tensor(wanted)
    log_probs = torch.log_softmax(logits[rows], dim=-1)
    chosen = torch.tensor([token_ids[i] for i in wanted])
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


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax after temperature, top-k and top-p (rows: random params)."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperatures
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= torch.tensor(top_ps).unsqueeze(1), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
    return logits.softmax(dim=-1)
