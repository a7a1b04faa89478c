"""Speculative decoding: a small drafter proposes k tokens, the target checks them all in one forward.

A decode step of a large model reads all of its weights to produce one token per sequence; a forward
over k + 1 tokens of the same sequence reads them once too, so it costs little more on a memory-bound
machine. The drafter (a smaller model with the same tokenizer) proposes k tokens one at a time at a
fraction of a target step; the target's one forward over [last token, d1 .. dk] gives k + 1
distributions, and rejection sampling (Leviathan et al. 2023, Chen et al. 2023) keeps a prefix of the
drafts plus one token of the target's own, so that every emitted token is distributed exactly as plain
sampling from the target would draw it. Greedy requests accept a draft while it equals the target's
argmax: their output is the target's greedy output.

KV cache: the drafter has a cache of its own with the same block layout, addressed through the
target's block tables, so one block manager keeps the books of both. The target writes K/V at all
k + 1 verified positions; those of rejected drafts are rolled back (the sequence's computed count
stops after the accepted ones, and tail blocks holding only rejected positions return to the free
list). The drafter computes only when a round is due: it catches up on what it has not seen (a prompt,
tokens decoded while rounds were declined, a fully accepted round's last draft, which it never ran) in
the round's first forward. So a prompt's first token waits for the target's prefill alone, and under a
load that declines rounds the drafter costs nothing; when more is left to catch up than a step's token
budget (`max_num_batched_tokens`), the step is a plain one beside a drafter forward over that budget
(`catch_up`), so no step grows past what a prefill chunk costs. Each block records whether the drafter's
cache holds it (`Block.in_draft_cache`): a prefix shared later brings the drafter's K/V along where it
has them, and is caught up where not.

Round lengths adapt. With per-draft acceptance probability α (a running average of what the target accepted) and
drafter / target cost ratio r, a round of k drafts emits (1 - α^(k+1)) / (1 - α) tokens per sequence in k drafter
steps and one verification over k + 1 rows per sequence, whose extra rows are not free where the target's products
are bound by arithmetic beyond a row or take more than one pass over the weights (`ForwardCost`,
`best_num_drafts`). When no k beats plain decoding by a margin that grows with the batch
(`MIN_MODELLED_GAIN_PER_SEQUENCE`) — a batch too large, drafts rejected too often — the round is declined: a plain
step. While rounds are declined the drafter computes nothing, and α drifts back towards its optimistic
prior, so rounds are tried again. A round that runs drafts the best k for α, or, adaptive, while one more draft
pays (`worth_another_draft`), up to num_speculative_tokens: the drafter's probability for its own token predicts
the target's acceptance (`SpeculativeStats.accepted_by_confidence`; `bench.speculative` reports it), so rounds run
long through confident stretches and stop at a guess. A lone sequence's rounds adapt: that emits more tokens per
target forward for a few more drafts, and led the α rule at batch 1 on every CPU measured since 2026-12-05. A
batch's rounds follow α: every sequence drafts the same k, which adaptive rounds set by the batch's pooled
confidence, and at batch 4 they lost on several CPUs (BENCHMARKS.md). `speculative_adaptive_drafts` forces either
rule. r is the ratio of the models' weight bytes (a decode forward
streams its weights), not a timing, so that k, and with it a seeded sampled request's draws, depends only on tokens
and the configuration. It does depend on the other requests in the engine (α and the batch are shared): with
speculation on, a seed reproduces a request's samples for the same sequence of requests, no longer whatever the
batch.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from engines.block_manager import BlockManager
from engines.cpu_kernels import ForwardCost
from engines.model_runner import ModelRunner, TokenSpan
from engines.outputs import TokenLogprob
from engines.quantization import tensor_key
from engines.sampler import argmax_ids, draw, filtered_probs, token_logprobs
from engines.sequence import Sequence

_EMA_WEIGHT = 0.1  # weight of the newest round in the running average of α
_ALPHA_PRIOR = 0.8  # optimistic start: k begins high and settles as rounds are judged
# Each declined round moves α this much of the way back to the prior, so that speculation that stopped paying
# (a run of rejected drafts, a large batch) is tried again after some tens of plain steps.
_DECLINED_WEIGHT = 0.02
# A round runs only when the cost model promises a gain over a plain step of this much per sequence in the batch,
# up to a cap. The model leaves out what a round costs beyond forwards (sampling and acceptance per row, the
# drafter's rows costing more than the target's), which grows with the batch: at batch 4 on AVX2, rounds it put at
# +4 % lost 13-19 % against plain decoding (BENCHMARKS.md, 2026-12-04 late), hence 15 % from batch 3 on. At batch 1
# that margin cost instead: one rejected draft moves α enough to decline, and declined rounds learn nothing until
# α relaxes — a Zen 2 declined most steps of some answers, 1.17x against 1.33-1.36x at 5 % (2026-12-05, night).
MIN_MODELLED_GAIN_PER_SEQUENCE = 0.05
MIN_MODELLED_GAIN_CAP = 0.15
FREE_ROWS = ForwardCost()  # extra rows cost nothing: the weights stream once for all of them
CONFIDENCE_BINS = (0.0, 0.5, 0.9, 0.99)  # lower edges of SpeculativeStats' confidence bins


@dataclass
class SpeculativeStats:
    num_rounds: int = 0
    num_draft_tokens: int = 0  # proposed by the drafter
    num_tested_tokens: int = 0  # drafts the target judged (those after a rejection are never looked at)
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts plus one target token per sequence and round
    draft_seconds: float = 0.0  # time in drafter forwards (and draft sampling)
    verify_seconds: float = 0.0  # time in target forwards
    # Drafts judged and accepted by the drafter's probability for its own token (adaptive drafts only), in
    # bins [0, 0.5), [0.5, 0.9), [0.9, 0.99), [0.99, 1]: how well that probability predicts acceptance.
    judged_by_confidence: list[int] = field(default_factory=lambda: [0] * len(CONFIDENCE_BINS))
    accepted_by_confidence: list[int] = field(default_factory=lambda: [0] * len(CONFIDENCE_BINS))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts judged: the per-token acceptance probability α."""
        return self.num_accepted_tokens / self.num_tested_tokens if self.num_tested_tokens else 0.0


@dataclass
class Verified:
    """One sequence's outcome of a round: the accepted drafts, then one token of the target's."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    num_accepted: int


def greedy_accept(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Drafts up to the first that differs from the target's argmax, then the target's token there
    (`target_argmax` has one entry more than the drafts: the bonus token after all of them)."""
    emitted: list[int] = []
    for draft, target in zip(draft_token_ids, target_argmax, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_argmax[len(draft_token_ids)])
    return emitted


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None) -> list[int]:
    """Emit a prefix of the drafts and one more token so that the output is distributed as sampling from the target.

    target_probs [k + 1, V], draft_probs [k, V]: the (filtered) distributions each draft position was
    drawn from by the drafter and is judged by under the target. Draft x is kept with probability
    min(1, p(x) / q(x)); the first one rejected is replaced by a draw from max(0, p - q) renormalised;
    when all are kept, a bonus token is drawn from the target's next distribution.
    """
    emitted: list[int] = []
    for i, token_id in enumerate(draft_token_ids):
        p, q = float(target_probs[i, token_id]), float(draft_probs[i, token_id])
        if float(torch.rand((), generator=generator)) * q < p:
            emitted.append(token_id)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the rejection had probability ~0
            residual = target_probs[i]
        emitted.append(draw(residual, generator))
        return emitted
    emitted.append(draw(target_probs[len(draft_token_ids)], generator))
    return emitted


def best_num_drafts(alpha: float, cost_ratio: float, max_drafts: int, batch_size: int = 1,
                    forward_cost: ForwardCost = FREE_ROWS) -> int:
    """The k in [1, max_drafts] that maximises expected tokens per unit of time, or 0 when no round beats a
    plain step by `MIN_MODELLED_GAIN_PER_SEQUENCE` per sequence of the batch (at most `MIN_MODELLED_GAIN_CAP`).

    Time is counted in one-row target forwards: a forward over n rows costs f(n) = `forward_cost(n)` (the weights
    stream once; the rows' arithmetic, or further passes over the weights, come on top), a drafter forward
    cost_ratio times that. A plain step of B sequences emits one token each in f(B); a round emits
    E(k) = (1 - α^(k+1)) / (1 - α) each in k · cost_ratio · f(B) + f(B · (k + 1)).
    """
    alpha = min(max(alpha, 0.0), 0.999)

    def speedup(k: int) -> float:
        expected_tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        plain = forward_cost(batch_size)
        return expected_tokens * plain / (k * cost_ratio * plain + forward_cost(batch_size * (k + 1)))

    best = max(range(1, max_drafts + 1), key=speedup)
    margin = min(MIN_MODELLED_GAIN_PER_SEQUENCE * batch_size, MIN_MODELLED_GAIN_CAP)
    return best if speedup(best) > 1 + margin else 0


def worth_another_draft(survival: list[float], expected_tokens: float, num_drafts: int, alpha: float,
                        cost_ratio: float, forward_cost: ForwardCost = FREE_ROWS) -> bool:
    """Whether drafting one more token raises the round's expected tokens per unit of time.

    `survival[i]`: the probability that sequence i's drafts so far are all accepted (the product of the
    drafter's probabilities for its drafted tokens); `expected_tokens`: what the round emits so far in
    expectation (one target token per sequence plus the sum of survivals after each draft). Time in one-row
    target forwards as in `best_num_drafts`: one more draft costs a drafter forward and one verification row
    per sequence, and adds α · survival[i] tokens to sequence i. It pays when that marginal rate beats the
    round's rate so far.
    """
    batch_size = len(survival)
    plain = forward_cost(batch_size)
    verified_rows = batch_size * (num_drafts + 1)
    per_draft = cost_ratio * plain + forward_cost(verified_rows + batch_size) - forward_cost(verified_rows)
    round_time = num_drafts * cost_ratio * plain + forward_cost(verified_rows)
    return alpha * sum(survival) / per_draft > expected_tokens / round_time


def _for_sampling(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Logits where the round's draws can use them: greedy choices run wherever the logits are, random ones on the
    host, where the sequences' generators are."""
    return logits if all(seq.params.greedy for seq in seqs) else logits.cpu()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (each tensor once, however often it is shared)."""
    tensors = {tensor_key(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Speculator:
    """The drafter of one engine: its model runner (own KV cache, the target's block tables) and k's adaptation."""

    def __init__(self, runner: ModelRunner, max_drafts: int, cost_ratio: float, forward_cost: ForwardCost = FREE_ROWS,
                 adaptive_drafts: bool | None = None) -> None:
        if max_drafts < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.runner = runner
        self.max_drafts = max_drafts
        # True: a round drafts up to max_drafts while another draft pays (`worth_another_draft`); False: each
        # round drafts the k that `best_num_drafts` expects from α alone; None: True for a round of one sequence.
        self.adaptive_drafts = adaptive_drafts
        self.cost_ratio = cost_ratio  # drafter forward / target forward, in weight bytes streamed
        self.forward_cost = forward_cost  # the target's, see best_num_drafts
        self.stats = SpeculativeStats()
        self._alpha = _ALPHA_PRIOR

    def num_behind(self, seqs: list[Sequence]) -> int:
        """Tokens of `seqs` the drafter has yet to compute before it can draft (a round's first forward)."""
        return sum(seq.num_tokens - seq.num_draft_computed_tokens for seq in seqs)

    def catch_up(self, seqs: list[Sequence], budget: int, block_manager: BlockManager) -> None:
        """One drafter forward over up to `budget` of the computed tokens it lags by, sequence by sequence: beside
        a plain step, where a round is due but would begin with more than a step's budget of catching up."""
        spans = []
        for seq in seqs:
            start = seq.num_draft_computed_tokens
            end = min(seq.num_computed_tokens, start + budget)
            if start < end:
                spans.append(TokenSpan(seq.token_ids[start:end], start, seq.block_table, "none"))
                seq.num_draft_computed_tokens = end
                budget -= end - start
            if not budget:
                break
        if spans:
            started = time.perf_counter()
            self.runner.forward(spans)
            self.stats.draft_seconds += time.perf_counter() - started
        for seq in seqs:
            block_manager.mark_drafted_blocks(seq)

    def adapts(self, num_seqs: int) -> bool:
        """Whether a round of `num_seqs` sequences drafts while another draft pays, rather than the k α suggests."""
        return self.adaptive_drafts if self.adaptive_drafts is not None else num_seqs == 1

    def num_drafts(self, seqs: list[Sequence], max_model_len: int) -> int:
        """This round's most drafts, capped so that no sequence runs past its length limits (0: no round): the
        adapted k, or with adaptive drafts `max_drafts` (the round itself stops where drafts stop paying)."""
        k = best_num_drafts(self._alpha, self.cost_ratio, self.max_drafts, len(seqs), self.forward_cost)
        if k == 0:
            self._alpha += _DECLINED_WEIGHT * (_ALPHA_PRIOR - self._alpha)
            return 0
        if self.adapts(len(seqs)):
            k = self.max_drafts
        for seq in seqs:
            # The round computes positions up to num_tokens - 1 + k and emits up to k + 1 tokens.
            k = min(k, max_model_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def step(self, seqs: list[Sequence], k: int, target: ModelRunner, block_manager: BlockManager) -> list[Verified]:
        """One round for decoding sequences whose blocks have room for k + 1 more tokens: draft, verify, roll back.

        On return each sequence's computed counts and block table cover exactly the accepted tokens;
        the caller appends `Verified.token_ids`.
        """
        started = time.perf_counter()
        drafts, draft_probs, confidences = self._propose(seqs, k)
        k = len(drafts[0])  # adaptive drafts may have stopped early
        drafted = time.perf_counter()
        spans = [TokenSpan([seq.token_ids[-1], *draft], seq.num_tokens - 1, seq.block_table, "all",
                           as_decode_rows=True)
                 for seq, draft in zip(seqs, drafts, strict=True)]
        logits = _for_sampling(target.forward(spans), seqs).view(len(seqs), k + 1, -1)
        verified_at = time.perf_counter()
        results = [self._accept(seq, draft, probs, rows)
                   for seq, draft, probs, rows in zip(seqs, drafts, draft_probs, logits, strict=True)]
        for seq, result in zip(seqs, results, strict=True):
            self._roll_back(seq, len(result.token_ids), block_manager)
        self._learn(results, k, confidences)
        self.stats.draft_seconds += drafted - started
        self.stats.verify_seconds += verified_at - drafted
        return results

    def _propose(self, seqs: list[Sequence], k: int
                 ) -> tuple[list[list[int]], list[torch.Tensor | None], list[list[float]]]:  # fmt: skip
        """Up to k drafts per sequence, as many for each (one drafter forward per draft); for sampled requests the
        distributions they came from; with adaptive drafts the drafter's probability of each draft (else empty)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        survival, expected_tokens = [1.0] * len(seqs), float(len(seqs))
        confidence: list[list[float]] = [[] for _ in seqs]
        adaptive = self.adapts(len(seqs))
        # The drafter is one or two tokens behind (a fully accepted round's last draft was never fed back): decode
        # rows; at a sequence's first round or after declined ones, the prompt or tokens decoded meanwhile: a chunk.
        behind = [seq.token_ids[seq.num_draft_computed_tokens:] for seq in seqs]
        spans = [TokenSpan(tokens, seq.num_draft_computed_tokens, seq.block_table, as_decode_rows=len(tokens) <= 2)
                 for seq, tokens in zip(seqs, behind, strict=True)]
        for j in range(k):
            if j and adaptive and not worth_another_draft(
                    survival, expected_tokens, j, self._alpha, self.cost_ratio, self.forward_cost):
                break
            logits = _for_sampling(self.runner.forward(spans), seqs)
            for i, seq in enumerate(seqs):
                if seq.params.greedy:
                    row = torch.softmax(logits[i].float(), dim=-1) if adaptive else logits[i]
                    token_id = int(argmax_ids(row))
                else:
                    row = filtered_probs(logits[i:i + 1], [seq.params])[0]
                    token_id = draw(row, seq.generator)
                    probs[i].append(row)
                drafts[i].append(token_id)
                if adaptive:
                    confidence[i].append(float(row[token_id]))
                    survival[i] *= confidence[i][-1]
            expected_tokens += sum(survival)
            spans = [TokenSpan([draft[-1]], seq.num_tokens + j, seq.block_table) for seq, draft in zip(seqs, drafts,
                                                                                                       strict=True)]
        for seq, draft in zip(seqs, drafts, strict=True):
            seq.num_draft_computed_tokens = seq.num_tokens - 1 + len(draft)  # the last draft was never fed back
        return drafts, [torch.stack(rows) if rows else None for rows in probs], confidence

    def _accept(self, seq: Sequence, draft: list[int], draft_probs: torch.Tensor | None,
                logits: torch.Tensor) -> Verified:
        if draft_probs is None:
            token_ids = greedy_accept(argmax_ids(logits).tolist(), draft)
        else:
            target_probs = filtered_probs(logits, [seq.params] * len(logits))
            token_ids = rejection_sample(target_probs, draft_probs, draft, seq.generator)
        num_accepted = len(token_ids) - 1
        logprobs = token_logprobs(logits[:len(token_ids)], token_ids, [seq.params] * len(token_ids))
        return Verified(token_ids, logprobs, num_accepted)

    def _roll_back(self, seq: Sequence, num_emitted: int, block_manager: BlockManager) -> None:
        """Keep the K/V of the last token and the accepted drafts; free blocks only rejected ones reached."""
        seq.num_computed_tokens += num_emitted
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
        block_manager.truncate(seq, seq.num_computed_tokens)
        block_manager.mark_drafted_blocks(seq)
        # The emitted tokens are appended after this: blocks they fill are offered in the next round.
        block_manager.cache_computed_blocks(seq)

    def _learn(self, results: list[Verified], k: int, confidences: list[list[float]]) -> None:
        stats = self.stats
        accepted = sum(result.num_accepted for result in results)
        tested = sum(min(result.num_accepted + 1, k) for result in results)
        stats.num_rounds += 1
        stats.num_draft_tokens += k * len(results)
        stats.num_tested_tokens += tested
        for result, drafted in zip(results, confidences, strict=True):
            for j, confidence in enumerate(drafted[:result.num_accepted + 1]):  # the drafts judged
                index = bisect_right(CONFIDENCE_BINS, confidence) - 1
                stats.judged_by_confidence[index] += 1
                stats.accepted_by_confidence[index] += j < result.num_accepted
        stats.num_accepted_tokens += accepted
        stats.num_emitted_tokens += sum(len(result.token_ids) for result in results)
        self._alpha += _EMA_WEIGHT * (accepted / tested - self._alpha)
