"""Sampler: greedy, temperature, top-k, top-p, per-request generators, logprobs of the unmodified distribution."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from engines.cpu_kernels import logprob_rows, sample_rows
from engines.sampler import (
    NUCLEUS_CANDIDATES,
    argmax_ids,
    candidates,
    draw,
    draw_kept,
    draw_native,
    filtered_probs,
    greedy_logprobs,
    greedy_tokens,
    sample,
    token_logprobs,
    top_k_top_p,
)
from engines.sampling_params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0], [0.0, 0.1, 0.2, 5.0, 0.3]])


def generators(*seeds: int) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def draw_many(params: SamplingParams, row: int = 0, n: int = 300) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {sample(LOGITS[row:row + 1], [params], [generator])[0][0] for _ in range(n)}


def test_greedy_takes_the_argmax_of_each_row() -> None:
    tokens, logprobs = sample(LOGITS, [SamplingParams(temperature=0)] * 2, [None, None])
    assert tokens == [1, 3]
    assert logprobs == [None, None]


def test_greedy_ids_are_torchs_argmax_ties_nan_and_infinities_included() -> None:
    logits = torch.randn(6, 151_936, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 90_000]] = float("nan")  # NaN counts as the maximum, the first one wins
    logits[1] = float("-inf")
    logits[2, [3, 9]] = 100.0  # equal maxima: the first
    logits[3, [151_935, 2]] = float("inf")
    strided = logits[:, ::2]  # a view that is not contiguous
    for rows in (logits, strided, logits[4], logits.bfloat16()):
        assert torch.equal(argmax_ids(rows), rows.argmax(dim=-1))
    assert argmax_ids(logits).tolist()[:4] == [7, 0, 3, 2]


@pytest.mark.parametrize("kernel", [True, False])
def test_a_greedy_step_gives_each_rows_argmax_and_its_log_softmax_there(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a greedy step reports where the LM head cannot (no AMX, CUDA): the argmax of the logits, and with
    logprobs asked, the log-softmax at it — the value `sample` reports for the same rows; nothing without."""
    if not kernel:
        monkeypatch.setattr("engines.sampler.logprob_rows", lambda: None)
    logits = torch.randn(5, 151_936, generator=torch.Generator().manual_seed(1)) * torch.tensor([[0.1], [1], [3],
                                                                                                  [10], [30]])
    chosen = greedy_tokens(logits, with_logprobs=True)
    assert torch.equal(chosen.token_ids, logits.argmax(dim=-1)) and chosen.logprobs is not None
    params = [SamplingParams(temperature=0, logprobs=True)] * 4 + [SamplingParams(temperature=0)]
    expected = sample(logits, params, [None] * 5)[1]
    reported = greedy_logprobs(chosen, params)
    assert reported[4] is None and expected[4] is None
    for ours, theirs in zip(reported[:4], expected[:4], strict=True):
        assert ours is not None and theirs is not None
        assert (ours.token_id, ours.top) == (theirs.token_id, [])
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    assert greedy_tokens(logits).logprobs is None


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    assert draw_many(SamplingParams(temperature=5.0, top_k=2)) == {1, 2}
    assert draw_many(SamplingParams(temperature=5.0, top_k=1)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # Row 0's probabilities: 0.63, 0.23, 0.09, ... — 0.63 alone does not reach 0.7, the top two do.
    assert draw_many(SamplingParams(temperature=1.0, top_p=0.7)) == {1, 2}
    assert draw_many(SamplingParams(temperature=1.0, top_p=0.5)) == {1}
    assert draw_many(SamplingParams(temperature=5.0, top_p=0.0)) == {1}  # OpenAI takes 0: the most likely alone
    assert filtered_probs(LOGITS, [SamplingParams(temperature=5.0, top_p=0.0)] * 2).tolist() == [
        [0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]]


def top_k_top_p_by_sorting(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """The definition: sort each whole row, keep its top k, then the smallest prefix whose renormalised mass reaches
    top p (the most likely id always)."""
    values, ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
    values = values.masked_fill(ranks >= torch.tensor(top_ks).unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= torch.tensor(top_ps).unsqueeze(1)
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, ids, values.masked_fill(drop, float("-inf")))


def test_top_k_and_top_p_keep_what_sorting_the_whole_row_keeps_whether_or_not_the_candidates_hold_it() -> None:
    vocab = 40_000
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, vocab, generator=generator) * 6  # the nucleus lies among the first candidates
    flat = torch.randn(4, vocab, generator=generator) * 0.1  # it lies among the next, or only a sort finds it
    masked = torch.randn(2, vocab, generator=generator)
    masked[:, 500:] = float("-inf")  # a grammar's or min-p's mask: fewer finite ids than candidates
    beyond_likely = torch.full((1, vocab), -20.0)
    beyond_likely[0, :2300] = 0.2 + torch.rand(2300, generator=generator) / 2  # under a 1e-4 share of the top ids
    # Three likely ids hold 95.5% of the mass: a top p of 0.98 reaches past them. Each id beyond moves the running
    # mass by ~2e-5, a hundred times float32's rounding of it, so no summation order can disagree on where it
    # stops (with 300 likely ids each moved it by 2e-7, and the AVX2 and AVX-512 builds parted by one id).
    beyond_likely[0, :3] = 10.0
    logits = torch.cat([peaked, flat, masked, beyond_likely])
    top_ks = [vocab, 50, 3000, vocab, 2000, 10, vocab, vocab, 700, vocab]
    top_ps = [0.9, 1.0, 0.95, 0.9, 0.5, 0.3, 0.4, 0.8, 0.99, 0.98]
    expected = top_k_top_p_by_sorting(logits, top_ks, top_ps)
    kept = torch.full_like(logits, float("-inf"))
    for row, (values, ids) in enumerate(top_k_top_p(logits, torch.tensor(top_ks), torch.tensor(top_ps))):
        assert torch.all(values[:-1] >= values[1:])  # most likely first
        kept[row, ids] = values
    assert torch.equal(kept.isfinite(), expected.isfinite())
    assert torch.equal(kept[kept.isfinite()], logits[kept.isfinite()])
    num_kept = kept.isfinite().sum(dim=-1).tolist()
    assert num_kept[0] < NUCLEUS_CANDIDATES[0] < num_kept[6] < NUCLEUS_CANDIDATES[1] < num_kept[3]  # every stage ran
    assert 3 < num_kept[9] < NUCLEUS_CANDIDATES[0]  # past the likely ids, within the candidates


def test_a_draw_follows_the_weights_never_picks_a_zero_and_repeats_under_a_seed() -> None:
    weights = torch.zeros(5_000)
    weights[[3, 1023, 1024, 2500, 4999]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25]) * 7  # unnormalised, 5 blocks
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(weights, generator) for _ in range(20_000)]), minlength=5_000)
    assert set(counts.nonzero().squeeze(1).tolist()) == {3, 1023, 1024, 2500, 4999}
    shares = counts[[3, 1023, 1024, 2500, 4999]] / 20_000
    assert shares.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.15, 0.25], abs=0.015)  # ~5 standard errors
    def draws(seed: int) -> list[int]:
        seeded = torch.Generator().manual_seed(seed)
        return [draw(weights, seeded) for _ in range(30)]
    assert draws(1) == draws(1) != draws(2)


@pytest.mark.skipif(sample_rows() is None, reason="the CPU sampling kernel needs a C compiler and AVX2")
def test_the_kernel_draws_the_token_the_python_rule_draws_at_the_same_variate() -> None:
    vocab = 40_000
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, vocab, generator=generator) * 6  # a model's confident rows: few likely ids
    masked = torch.randn(2, vocab, generator=generator)
    masked[:, 500:] = float("-inf")  # a grammar's or min_tokens' mask: fewer finite ids than a top k of 3000
    flat = torch.randn(1, vocab, generator=generator) * 0.1  # every id likely: a nucleus found by a histogram
    logits = torch.cat([peaked, masked, flat])
    # At the ends of [0, 1) the two may part by a rounding (their sums add in different orders): only finite there.
    extremes = {0.0, 1.0 - 2.0 ** -53}
    variates = [*extremes, *torch.rand(30, dtype=torch.float64, generator=generator).tolist()]
    flat_agree = flat_total = 0
    for temperature, top_k, top_p, min_p in itertools.product((0.7, 1.3), (0, 5, 3000), (1.0, 0.9), (0.0, 0.05)):
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * len(logits)
        expected = candidates(logits, params)
        for u in variates:
            drawn = draw_native(logits, range(len(logits)), params, dict.fromkeys(range(len(logits)), u))
            too_many_to_list = min_p > 0 and top_k > 0  # the flat row's min-p set, whose top k is left to PyTorch
            assert set(drawn) == set(range(5 if too_many_to_list else 6))
            for row, (token, _) in drawn.items():
                assert logits[row, token].isfinite()
                if u in extremes:
                    continue
                same = token == draw_kept(*expected[row], u)
                if row < 5:
                    assert same
                else:  # PyTorch's float32 sums over 40,000 similar ids may move the nucleus's edge by an id or two
                    flat_agree, flat_total = flat_agree + same, flat_total + 1
    assert flat_agree >= 0.95 * flat_total


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_most_likely_ones_probability() -> None:
    # Row 0's probabilities: 0.62, 0.23, 0.08, 0.05, 0.01 — 0.3 of the top is 0.19, 0.1 of it 0.06.
    assert draw_many(SamplingParams(temperature=1.0, min_p=0.3)) == {1, 2}
    assert draw_many(SamplingParams(temperature=1.0, min_p=0.1)) == {0, 1, 2}
    assert draw_many(SamplingParams(temperature=1.0, min_p=1.0)) == {1}


def test_without_filters_every_token_can_be_drawn() -> None:
    assert draw_many(SamplingParams(temperature=3.0), n=1000) == {0, 1, 2, 3, 4}


def test_the_same_seed_draws_the_same_tokens() -> None:
    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(LOGITS[:1], [SamplingParams(temperature=2.0)], [generator])[0][0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_logprobs_ignore_temperature_and_filters() -> None:
    params = SamplingParams(temperature=0.3, top_k=1, logprobs=True, top_logprobs=3)
    tokens, logprobs = sample(LOGITS[:1], [params], generators(0))
    expected = torch.log_softmax(LOGITS[0], dim=-1)
    (logprob,) = logprobs
    assert logprob is not None and logprob.token_id == tokens[0] == 1
    assert logprob.logprob == pytest.approx(expected[1].item())
    assert [token for token, _ in logprob.top] == [1, 2, 0]
    assert [value for _, value in logprob.top] == pytest.approx(expected[[1, 2, 0]].tolist())


def test_logprobs_match_log_softmax_on_wide_rows_of_large_logits() -> None:
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(0)) * 60
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=2)]
    tokens, logprobs = sample(logits, params, [None] * 4)
    expected = torch.log_softmax(logits, dim=-1)
    for row in (0, 2, 3):
        logprob = logprobs[row]
        assert logprob is not None and logprob.logprob == pytest.approx(expected[row, tokens[row]].item(), abs=1e-4)
        top_values, top_ids = expected[row].topk(params[row].top_logprobs)
        assert [token for token, _ in logprob.top] == top_ids.tolist()
        assert [value for _, value in logprob.top] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert logprobs[1] is None


@pytest.mark.skipif(logprob_rows() is None, reason="the CPU logprob kernel needs a C compiler and AVX2")
def test_the_logprob_kernel_gives_log_softmax_at_the_chosen_and_top_ids_masks_and_ties_included() -> None:
    vocab = 151_937  # not a multiple of the kernel's lanes or blocks
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 8
    logits[1, 1000:] = float("-inf")  # a grammar's mask
    logits[2, [7, 3, 11]] = logits[2].max() + 1  # three equal maxima: the lowest id first
    logits[3] = float("-inf")
    logits[3, [9, 5]] = 0.0  # fewer finite logits than the top asked for: padded at -inf
    chosen = [0, 999, 151_936, 9]
    chosen_lp, top_ids, top_lp = logprob_rows()(logits, chosen, 20)  # type: ignore[misc]
    expected = torch.log_softmax(logits, dim=-1)
    assert chosen_lp.tolist() == pytest.approx(expected[range(4), chosen].tolist(), abs=1e-5)
    for row in range(3):
        values, ids = expected[row].topk(20)
        assert top_lp[row].tolist() == pytest.approx(values.tolist(), abs=1e-5)
        assert top_ids[row, 3:].tolist() == ids[3:].tolist()
    assert top_ids[2, :3].tolist() == [3, 7, 11]
    assert top_ids[3, :2].tolist() == [5, 9] and top_lp[3, :2].tolist() == pytest.approx([math.log(0.5)] * 2)
    assert top_lp[3, 2:].eq(float("-inf")).all()


@pytest.mark.skipif(sample_rows() is None, reason="the CPU kernels need a C compiler and AVX2")
def test_without_the_kernels_a_seed_samples_the_same_tokens_with_the_same_logprobs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(6, 30_000, generator=torch.Generator().manual_seed(1)) * 5
    params = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=1.0, top_k=40, logprobs=True),
              SamplingParams(temperature=1.2, min_p=0.02),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=8, top_p=0.5, min_p=0.1)]

    def run() -> tuple[list[list[int]], list[list[float]]]:
        seeded = generators(*range(6))
        steps = [sample(logits, params, seeded) for _ in range(20)]
        values = [[lp.logprob for lp in logprobs if lp is not None] for _, logprobs in steps]
        return [tokens for tokens, _ in steps], values

    tokens, values = run()
    monkeypatch.setattr("engines.sampler.sample_rows", lambda: None)
    monkeypatch.setattr("engines.sampler.logprob_rows", lambda: None)
    tokens_torch, values_torch = run()
    assert tokens == tokens_torch
    assert [v for step in values for v in step] == pytest.approx([v for step in values_torch for v in step], abs=1e-5)


@pytest.mark.skipif(sample_rows() is None, reason="the CPU kernels need a C compiler and AVX2")
def test_a_draw_at_temperature_1_gives_its_tokens_logprob_and_the_logprob_pass_would_give_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the draw summed the whole row (temperature 1, no min-p, any top-k or top-p) its logprob is the logprob
    kernel's, to the bit; elsewhere (another temperature, min-p, a penalty) that kernel gives it."""
    logits = torch.randn(6, 151_936, generator=torch.Generator().manual_seed(2)) * 4
    params = [SamplingParams(temperature=1.0, logprobs=True),
              SamplingParams(temperature=1.0, top_p=0.9, logprobs=True),
              SamplingParams(temperature=1.0, top_k=50, logprobs=True),
              SamplingParams(temperature=0.7, logprobs=True),
              SamplingParams(temperature=1.0, min_p=0.05, logprobs=True),
              SamplingParams(temperature=1.0, top_p=0.9, logprobs=True, top_logprobs=2)]
    uniforms = dict.fromkeys(range(6), 0.37)
    drawn = draw_native(logits, range(6), params, uniforms)
    assert [not math.isnan(logprob) for _, logprob in drawn.values()] == [True, True, True, False, False, True]
    expected = logprob_rows()(logits, [token for token, _ in drawn.values()], 0)[0].tolist()  # type: ignore[misc]
    assert [logprob for _, logprob in drawn.values()][:3] == expected[:3]

    calls: list[int] = []  # rows the logprob pass still reads
    kernel = logprob_rows()
    assert kernel is not None

    class Counted:
        supports = staticmethod(kernel.supports)

        def __call__(self, rows: torch.Tensor, chosen: list[int], top_n: int) -> object:
            calls.append(len(rows))
            return kernel(rows, chosen, top_n)

    monkeypatch.setattr("engines.sampler.logprob_rows", Counted)
    tokens, logprobs = sample(logits, params, generators(*range(6)))
    reread = token_logprobs(logits, tokens, params)  # every row through the logprob pass
    assert [lp.logprob for lp in logprobs if lp] == [lp.logprob for lp in reread if lp]
    assert calls[0] == 3  # the temperature 0.7, min-p and top-logprobs rows only
    penalised = [dataclasses.replace(p, presence_penalty=0.5) for p in params]
    calls.clear()
    sample(logits, penalised, generators(*range(6)), [[1, 2]] * 6)
    assert calls[0] == 6  # the draw read adjusted logits: their sums are not the reported distribution's


def test_logprobs_are_given_only_to_the_rows_that_asked() -> None:
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0)]
    _, logprobs = sample(LOGITS, params, [None, None])
    assert logprobs[0] is not None and logprobs[0].top == []
    assert logprobs[1] is None


# -- penalties and logit bias (OpenAI semantics) -------------------------------------------------


def test_zero_penalties_and_no_bias_leave_greedy_output_unchanged() -> None:
    plain = SamplingParams(temperature=0)
    zeroed = SamplingParams(temperature=0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={})
    history = [[1, 1, 1], [3, 3]]
    assert sample(LOGITS, [zeroed] * 2, [None, None], history)[0] == sample(LOGITS, [plain] * 2, [None, None])[0]


def test_frequency_penalty_subtracts_per_occurrence_and_presence_penalty_once() -> None:
    params = [SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)] * 2
    from engines.sampler import adjust_logits

    adjusted = adjust_logits(LOGITS, params, [[1, 1, 2], []])
    expected = LOGITS.clone()
    expected[0, 1] -= 2 * 0.5 + 0.25
    expected[0, 2] -= 1 * 0.5 + 0.25
    assert torch.equal(adjusted, expected)


def test_a_repeated_token_loses_the_argmax_to_the_penalty() -> None:
    # Row 0 prefers token 1 (3.0) over token 2 (2.0): three earlier 1s at 0.5 each tip it.
    params = [SamplingParams(temperature=0, frequency_penalty=0.5)]
    assert sample(LOGITS[:1], params, [None], [[1, 1, 1]])[0] == [2]
    assert sample(LOGITS[:1], params, [None], [[1]])[0] == [1]


def test_the_repetition_penalty_divides_positive_logits_of_seen_tokens_and_multiplies_negative_ones() -> None:
    """vLLM's, over the prompt and the answer alike (`token_ids`), applied before OpenAI's penalties."""
    from engines.sampler import adjust_logits

    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    adjusted = adjust_logits(LOGITS, params, [[], []], seen_token_ids=[[1, 4, 1], [3]])
    expected = LOGITS.clone()
    expected[0, 1] /= 2.0  # 3.0 -> 1.5: token 2 (2.0) now leads
    expected[0, 4] *= 2.0  # -1.0 -> -2.0
    assert torch.equal(adjusted, expected)
    assert sample(LOGITS, params, [None, None], [[], []], seen_token_ids=[[1], [3]])[0] == [2, 3]


def test_min_tokens_keeps_the_end_tokens_out_until_that_many_tokens_were_generated() -> None:
    """vLLM's rule: EOS (unless ignored) and the row's stop tokens cannot be drawn before `min_tokens`."""
    eos, stop = 1, 3  # each row's most likely token
    held = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop])
    assert sample(LOGITS, [held, held], [None, None], [[5], [5]], eos_token_ids=[eos])[0] == [2, 4]
    assert sample(LOGITS, [held, held], [None, None], [[5, 5], [5, 5]], eos_token_ids=[eos])[0] == [1, 3]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(LOGITS[:1], [ignoring], [None], [[]], eos_token_ids=[eos])[0] == [1]  # EOS is no end for it
    drawn = {sample(LOGITS[:1], [SamplingParams(min_tokens=1)], generators(seed), [[]], eos_token_ids=[eos])[0][0]
             for seed in range(200)}
    assert eos not in drawn and len(drawn) > 1


def test_logit_bias_adds_to_each_listed_token_per_row() -> None:
    params = [SamplingParams(temperature=0, logit_bias={4: 100.0}), SamplingParams(temperature=0, logit_bias={3: -100})]
    assert sample(LOGITS, params, [None, None])[0] == [4, 4]


def test_logprobs_come_from_the_logits_before_penalties_and_bias() -> None:
    params = [SamplingParams(temperature=0, logit_bias={4: 100.0}, logprobs=True)]
    (token,), (logprob,) = sample(LOGITS[:1], params, [None])
    assert token == 4 and logprob is not None
    assert logprob.logprob == pytest.approx(torch.log_softmax(LOGITS[0], dim=-1)[4].item())


@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"logit_bias": {1: 101.0}},
    {"logit_bias": {i: 1.0 for i in range(301)}},
])
def test_out_of_range_penalties_and_bias_are_refused(bad: dict) -> None:
    with pytest.raises(AssertionError):  # the API's rules refuse them first, with a 400 naming the field
        SamplingParams(**bad)


# -- grammar masks -------------------------------------------------------------------------------------


class AllowOnly:
    """A grammar state that allows a fixed set of tokens (the sampler's view of a real one)."""

    def __init__(self, *allowed: int) -> None:
        self.allowed = allowed
        self.num_fills = 0

    def allows(self, token_id: int) -> bool:
        return token_id in self.allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.num_fills += 1
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token >> 5] |= 1 << (token & 31)


def test_a_constrained_greedy_row_takes_the_best_allowed_token_and_others_are_untouched() -> None:
    params = [SamplingParams(temperature=0)] * 2
    tokens, _ = sample(LOGITS, params, [None, None], grammars=[AllowOnly(0, 4), None])
    assert tokens == [0, 3]  # row 0: 1.0 beats -1.0; row 1 unconstrained
    assert sample(LOGITS, params, [None, None], grammars=[AllowOnly(1, 2), None])[0] == [1, 3]  # argmax allowed


def test_only_rows_whose_free_choice_the_grammar_refuses_pay_for_a_mask() -> None:
    kept, refused = AllowOnly(1, 4), AllowOnly(0, 4)  # the rows' free (greedy) choices: tokens 1 and 3
    tokens, _ = sample(LOGITS, [SamplingParams(temperature=0)] * 2, [None, None], grammars=[kept, refused])
    assert tokens == [1, 4]
    assert (kept.num_fills, refused.num_fills) == (0, 1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=3.0), SamplingParams(temperature=3.0, top_k=3),
                                    SamplingParams(temperature=3.0, top_p=0.9)])
def test_constrained_draws_only_ever_pick_allowed_tokens(params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(0)
    drawn = {sample(LOGITS[:1], [params], [generator], grammars=[AllowOnly(0, 3, 4)])[0][0] for _ in range(300)}
    assert drawn <= {0, 3, 4} and len(drawn) >= 2
