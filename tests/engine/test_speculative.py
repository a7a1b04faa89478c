"""Speculative decoding: greedy output is the target's own, sampling keeps the target's distribution,
rejected tokens' KV slots go back to the block manager, and k follows the acceptance rate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engines.config import EngineConfig
from engines.cpu_kernels import ForwardCost
from engines.llm_engine import LLMEngine
from engines.loader import Checkpoint
from engines.model_runner import TokenSpan
from engines.sampling_params import GrammarSpec, SamplingParams
from engines.sequence import Sequence
from engines.speculative import FREE_ROWS, best_num_drafts, greedy_accept, rejection_sample, worth_another_draft
from engines.tiers import TierSpec
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion
from tests.tiny_models import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], list(range(30, 52)), [1, 2, 3]]


def drafter_of(model: TinyModel, noise: float) -> Checkpoint:
    """The target's weights plus Gaussian noise (std `noise`): same tokenizer, agrees with the target often."""
    generator = torch.Generator().manual_seed(7)
    tensors = {name: tensor + noise * torch.randn(tensor.shape, generator=generator)
               for name, tensor in model.checkpoint.tensors.items()}
    return Checkpoint(config=model.checkpoint.config, tensors=tensors, tokenizer=model.checkpoint.tokenizer)


def sharpened(model: TinyModel, factor: float) -> Checkpoint:
    """The target with its logits scaled by `factor` (the final norm's weight): the same argmax everywhere, so every
    greedy draft is accepted, with the drafter sure of its tokens (factor ≫ 1) or guessing (factor ≪ 1)."""
    tensors = dict(model.checkpoint.tensors)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * factor
    return dataclasses.replace(model.checkpoint, tensors=tensors)


def speculative_engine(model: TinyModel, drafter: Checkpoint, **overrides: object) -> LLMEngine:
    # Fixed k unless a test says otherwise: these tests need rounds of several drafts, which adaptive drafting
    # would cut to one with a random tiny drafter (its distributions are nearly flat: it is never sure).
    settings: dict[str, object] = dict(model="tiny", dtype="float32", num_kv_blocks=64, block_size=4,
                                       max_num_seqs=8, max_num_batched_tokens=64, num_threads=1,
                                       num_speculative_tokens=4, speculative_adaptive_drafts=False)
    settings.update(overrides)
    engine = LLMEngine.from_checkpoint(model.checkpoint, EngineConfig(**settings), drafter=drafter)  # type: ignore[arg-type]
    # The drafter is the target's twin here, which never pays (a round would cost more than it emits): cost it
    # as a third of the target, about what the demo pair's weights are, and its verification rows as free (the
    # native int8 layers' cost would decline the rounds of three sequences), so that rounds run.
    assert engine.speculator is not None
    engine.speculator.cost_ratio, engine.speculator.forward_cost = 0.3, FREE_ROWS
    return engine


def generate_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run_to_completion(engine)
    return [generated_ids(outputs[f"r{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_token_identical_to_plain_decoding(tiny_model: TinyModel, batch: int) -> None:
    prompts = PROMPTS[:batch]
    plain = generate_all(make_engine(tiny_model), prompts, GREEDY)
    engine = speculative_engine(tiny_model, drafter_of(tiny_model, noise=0.01))
    assert generate_all(engine, prompts, GREEDY) == plain
    stats = engine.speculator.stats  # type: ignore[union-attr]
    # Both outcomes were exercised: some drafts were kept, some were rejected.
    assert 0 < stats.num_accepted_tokens < stats.num_tested_tokens


@pytest.mark.parametrize("batch", [1, 3])
def test_adaptive_rounds_run_long_behind_a_sure_drafter_and_stop_at_its_first_guess(tiny_qwen2: TinyModel,
                                                                                   batch: int) -> None:
    prompts = PROMPTS[:batch]
    plain = generate_all(make_engine(tiny_qwen2), prompts, GREEDY)
    drafts_per_round = {}
    for name, factor in (("sure", 1000.0), ("guessing", 1e-3)):
        engine = speculative_engine(tiny_qwen2, sharpened(tiny_qwen2, factor), speculative_adaptive_drafts=True)
        assert generate_all(engine, prompts, GREEDY) == plain
        stats = engine.speculator.stats  # type: ignore[union-attr]
        assert stats.num_accepted_tokens == stats.num_tested_tokens  # the same argmax: every draft judged is kept
        drafts_per_round[name] = stats.num_draft_tokens / (stats.num_rounds * batch)
        # Each draft judged is counted by the drafter's probability: ≥ 0.99 when sure, < 0.5 when guessing.
        in_its_bin = stats.judged_by_confidence[-1] if name == "sure" else stats.judged_by_confidence[0]
        assert in_its_bin == sum(stats.judged_by_confidence) == stats.num_tested_tokens
        assert stats.accepted_by_confidence == stats.judged_by_confidence
    assert drafts_per_round["sure"] > 3  # up to num_speculative_tokens = 4, less where max_tokens cuts a round
    assert drafts_per_round["guessing"] == 1


def test_by_default_a_lone_sequence_adapts_its_rounds_and_a_batch_follows_the_acceptance_rate(
        tiny_qwen2: TinyModel) -> None:
    # A guessing drafter whose guesses are all kept: adaptive rounds stop at its first guess, the acceptance
    # rate's rule (α near 1) drafts the most it may.
    drafts_per_round = {}
    for batch in (1, 3):
        engine = speculative_engine(tiny_qwen2, sharpened(tiny_qwen2, 1e-3), speculative_adaptive_drafts=None)
        generate_all(engine, PROMPTS[:batch], GREEDY)
        stats = engine.speculator.stats  # type: ignore[union-attr]
        drafts_per_round[batch] = stats.num_draft_tokens / (stats.num_rounds * batch)
    assert drafts_per_round[1] == 1
    assert drafts_per_round[3] > 2


def test_one_more_draft_pays_while_the_drafts_are_likely_kept_and_verification_rows_are_cheap() -> None:
    sure, unsure = [0.99], [0.3]
    assert worth_another_draft(sure, expected_tokens=1 + 0.99, num_drafts=1, alpha=0.87, cost_ratio=0.3,
                               forward_cost=ForwardCost(per_row=0.2))
    assert not worth_another_draft(unsure, expected_tokens=1 + 0.3, num_drafts=1, alpha=0.87, cost_ratio=0.3,
                                   forward_cost=ForwardCost(per_row=0.2))
    # Long confident rounds end too: each draft adds less to the round's rate than the last.
    survival, expected, drafts = [1.0], 1.0, 0
    while drafts < 100 and (drafts == 0 or worth_another_draft(survival, expected, drafts, 0.87, 0.3,
                                                                         ForwardCost(per_row=0.2))):
        drafts, expected = drafts + 1, expected + 1.0
    assert 3 <= drafts < 100
    # The same confidence pays for fewer drafts when verification rows cost more or the drafter costs more.
    assert not worth_another_draft(survival, 1 + 3.0, 3, 0.87, 0.3, ForwardCost(per_row=0.5))
    assert not worth_another_draft(survival, 1 + 3.0, 3, 0.87, cost_ratio=0.6, forward_cost=ForwardCost(per_row=0.2))
    # In a batch one sure sequence does not carry three that are already likely rejected.
    assert not worth_another_draft([0.95, 0.05, 0.05, 0.05], 4 + 1.1, 1, 0.87, 0.3, ForwardCost(per_row=0.2))


@pytest.mark.parametrize("quantization", ["w8a8", "int8"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_verification_rows_get_the_logits_plain_decoding_gets_bit_for_bit(tiny_qwen2: TinyModel,
                                                                          kv_cache_dtype: str,
                                                                          quantization: str) -> None:
    """Greedy speculation is exact only if verifying k + 1 tokens in one forward gives each the logits a
    decode step would: a last-bit difference flips near-ties. (On the demo models, w8a8 with a bfloat16
    cache, verification as a causal prefill chunk changed 3 of 4 greedy outputs in `bench/speculative.py`;
    as decode rows, none. The tiny model does not show that difference.) w8a8 and int8, as shipped on VNNI
    and on AVX2 CPUs (int8: through the native decode layers where the kernels run): their integer products
    make every row independent of the batch, where float32 GEMMs of 1 and 4 rows may round differently.
    Every row here has a context of three blocks, as its decode step would: decode attention pads a batch to
    its longest context, and that padding can move the last bit (a limit plain decoding has too, between
    batch compositions)."""
    prompt, block_table, tokens = PROMPTS[1][:8], [3, 4, 5], [61, 62, 63]
    verifier, decoder = (make_engine(tiny_qwen2, kv_cache_dtype=kv_cache_dtype, quantization=quantization).runner
                         for _ in range(2))
    for runner in (verifier, decoder):
        runner.forward([TokenSpan(prompt, 0, block_table, "none")])
    verified = verifier.forward([TokenSpan(tokens, len(prompt), block_table, "all", as_decode_rows=True)])
    decoded = torch.cat([decoder.forward([TokenSpan([token], len(prompt) + j, block_table)])
                         for j, token in enumerate(tokens)])
    assert torch.equal(verified, decoded)


def test_a_drafter_equal_to_the_target_has_every_draft_accepted(tiny_qwen2: TinyModel) -> None:
    plain = generate_all(make_engine(tiny_qwen2), PROMPTS[:2], GREEDY)
    engine = speculative_engine(tiny_qwen2, tiny_qwen2.checkpoint)
    assert generate_all(engine, PROMPTS[:2], GREEDY) == plain
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens == stats.num_tested_tokens == stats.num_draft_tokens > 0


def test_a_drafter_equal_to_the_target_keeps_every_draft_through_sharing_preemption_aborts_and_catch_ups(
    tiny_qwen2: TinyModel,
) -> None:
    """The drafter's K/V are right wherever it drafts from them: a twin of the target has every draft accepted
    while prefixes are shared before and after the drafter computed them, sequences are preempted and readmitted,
    requests are aborted, and catch-ups are cut to the step budget. Stale or missing drafter K/V would show as
    rejected drafts (the output itself is the target's whatever the drafter holds)."""
    import random

    rng = random.Random(5)
    prefixes = [list(range(200, 213)), list(range(300, 309))]
    prompts = [[*rng.choice(prefixes), *(rng.randrange(1, 500) for _ in range(rng.randrange(1, 9)))] for _ in range(10)]
    lengths = [rng.randrange(8, 28) for _ in prompts]
    aborted_at = {12: "r3", 40: "r7"}  # step -> request
    aborted = set(aborted_at.values())
    settings = dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=12)

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        outputs: dict[str, list] = {}
        pending = list(enumerate(zip(prompts, lengths, strict=True)))
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and step >= 25 * (pending[0][0] // 5):  # two waves, the second after the first decodes
                i, (prompt, max_tokens) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens))
            if step in aborted_at:
                engine.abort_request(aborted_at[step])
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
            step += 1
        return {rid: generated_ids(out) for rid, out in outputs.items() if rid not in aborted}

    expected = run(make_engine(tiny_qwen2, **settings))
    engine = speculative_engine(tiny_qwen2, tiny_qwen2.checkpoint, num_speculative_tokens=3, **settings)
    assert run(engine) == expected
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_rounds > 10 and stats.num_accepted_tokens == stats.num_tested_tokens
    assert engine.scheduler.num_preempted_total > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10, grammar=GrammarSpec("json_object")),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={7: 30.0}),
    SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.0),
], ids=["grammar", "penalties", "logit_bias", "sampled_penalties"])
def test_constrained_and_penalised_requests_decode_plainly_beside_a_speculative_one(
        tiny_qwen2: TinyModel, params: SamplingParams) -> None:
    """Drafts are judged by the target's raw distribution, which grammars, penalties and biases change: those
    requests must get plain decoding's output (a step holding one decodes plainly), and the engine speculates
    again once they are done."""
    def run(engine: LLMEngine) -> tuple[list[int], list[int]]:
        engine.add_request("plain", PROMPTS[0], GREEDY)
        engine.add_request("constrained", PROMPTS[1], params)
        outputs = run_to_completion(engine)
        return generated_ids(outputs["plain"]), generated_ids(outputs["constrained"])

    engine = speculative_engine(tiny_qwen2, tiny_qwen2.checkpoint)
    assert run(engine) == run(make_engine(tiny_qwen2))
    # The unconstrained request (24 tokens), once alone, was decoded speculatively.
    assert engine.speculator.stats.num_rounds > 0  # type: ignore[union-attr]


def test_max_tokens_and_stop_tokens_end_a_round_early(tiny_llama: TinyModel) -> None:
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    plain = generate_all(make_engine(tiny_llama), PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30,
                                                                                ignore_eos=True))[0]
    engine = speculative_engine(tiny_llama, tiny_llama.checkpoint)
    assert generate_all(engine, PROMPTS[:1], params)[0] == plain[:7]
    stop = plain[9]
    stopped = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    engine = speculative_engine(tiny_llama, tiny_llama.checkpoint)
    assert generate_all(engine, PROMPTS[:1], stopped)[0] == plain[:plain.index(stop) + 1]


def test_min_tokens_holds_a_request_open_as_in_plain_decoding(tiny_llama: TinyModel) -> None:
    """Until `min_tokens`, the stop token is masked out of the target's distribution, so drafts are not judged by
    it: the request decodes plainly, then speculates once the floor is reached."""
    free = generate_all(make_engine(tiny_llama), PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30,
                                                                               ignore_eos=True))[0]
    held = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[2]], min_tokens=6)
    expected = generate_all(make_engine(tiny_llama), PROMPTS[:1], held)[0]
    assert len(expected) > 6 and free[2] not in expected[:6]
    engine = speculative_engine(tiny_llama, tiny_llama.checkpoint)
    assert generate_all(engine, PROMPTS[:1], held)[0] == expected


def test_rejected_tokens_kv_slots_are_returned_to_the_block_manager(tiny_qwen2: TinyModel) -> None:
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, noise=0.01), enable_prefix_caching=False)
    manager = engine.block_manager
    free_before = manager.num_free_blocks
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    rounds_seen = 0
    while engine.has_unfinished_requests():
        rounds_before = engine.speculator.stats.num_rounds  # type: ignore[union-attr]
        engine.step()
        if engine.speculator.stats.num_rounds > rounds_before:  # type: ignore[union-attr]
            rounds_seen += 1
            running = engine.scheduler.running
            # Each sequence holds exactly the blocks its accepted tokens occupy; the rest are free.
            for seq in running:
                assert len(seq.block_table) == manager.num_blocks_for(seq.num_computed_tokens)
            assert manager.num_free_blocks == manager.num_blocks - sum(len(seq.block_table) for seq in running)
    assert rounds_seen > 0
    assert manager.num_free_blocks == free_before == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_prefix_cache_hits_stay_exact_with_a_drafter(tiny_qwen2: TinyModel) -> None:
    shared = list(range(100, 123))
    prompt = [*shared, 7, 8, 9]
    expected = generate_all(make_engine(tiny_qwen2, enable_prefix_caching=False), [prompt], GREEDY)[0]
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, noise=0.01))
    generate_all(engine, [[*shared, 1]], GREEDY)
    engine.add_request("ours", prompt, GREEDY)
    outputs = run_to_completion(engine)["ours"]
    assert outputs[0].num_cached_tokens == 20
    assert generated_ids(outputs) == expected


def drafter_rows(engine: LLMEngine) -> list[int]:
    """Tokens the drafter computes, one entry per drafter forward (recorded as the engine runs)."""
    assert engine.speculator is not None
    runner, rows = engine.speculator.runner, []
    forward = runner.forward

    def counting_forward(spans: list[TokenSpan], *args: object) -> torch.Tensor:
        rows.append(sum(len(span.token_ids) for span in spans))
        return forward(spans, *args)

    runner.forward = counting_forward  # type: ignore[method-assign]
    return rows


def test_a_prompt_waits_for_the_targets_prefill_alone_and_the_drafter_catches_it_up_at_the_first_round(
    tiny_qwen2: TinyModel,
) -> None:
    prompt = PROMPTS[1]
    expected = generate_all(make_engine(tiny_qwen2), [prompt], GREEDY)[0]
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, 0.01))
    rows = drafter_rows(engine)
    engine.add_request("r", prompt, GREEDY)
    first = engine.step()
    assert len(first[0].new_token_ids) == 1 and rows == []  # the first token: no drafter forward ran
    outputs = [*first, *run_to_completion(engine)["r"]]
    assert generated_ids(outputs) == expected
    assert rows[0] >= len(prompt)  # the first round's first forward: the whole prompt, then the first token
    assert engine.speculator.stats.num_rounds > 0  # type: ignore[union-attr]


def test_catching_up_a_long_prompt_is_spread_over_steps_within_the_token_budget(tiny_qwen2: TinyModel) -> None:
    prompt = list(range(40, 90))
    expected = generate_all(make_engine(tiny_qwen2), [prompt], GREEDY)[0]
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, 0.01), max_num_batched_tokens=16)
    rows = drafter_rows(engine)
    assert generate_all(engine, [prompt], GREEDY)[0] == expected
    assert max(rows) <= 16
    assert sum(rows[:3]) == 48 and rows[3] > 2  # three catch-up chunks, then a round catches up the rest


def test_a_prefix_cached_before_the_drafter_saw_it_is_caught_up_and_shared_with_the_drafter_after(
    tiny_qwen2: TinyModel,
) -> None:
    shared = list(range(100, 123))
    prompt = [*shared, 7, 8, 9]
    expected = generate_all(make_engine(tiny_qwen2, enable_prefix_caching=False), [prompt], GREEDY)[0]
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, 0.01))
    rows = drafter_rows(engine)
    generate_all(engine, [[*shared, 1]], dataclasses.replace(GREEDY, max_tokens=1))  # finishes at its prefill
    assert rows == []
    engine.add_request("second", prompt, GREEDY)
    outputs = run_to_completion(engine)["second"]
    assert outputs[0].num_cached_tokens == 20  # the target's blocks are shared though the drafter never ran
    assert generated_ids(outputs) == expected
    assert rows[0] >= len(prompt)  # its drafter computed the shared prefix too
    rows.clear()
    engine.add_request("third", prompt, GREEDY)
    outputs = run_to_completion(engine)["third"]
    assert generated_ids(outputs) == expected
    assert rows[0] < len(prompt) - 20 + 2  # now the drafter's cache holds the prefix: only the rest is computed


def test_seeded_sampling_through_the_drafter_is_reproducible(tiny_llama: TinyModel) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, ignore_eos=True, seed=11, logprobs=True)
    first = generate_all(speculative_engine(tiny_llama, drafter_of(tiny_llama, 0.01)), PROMPTS[:2], params)
    second = generate_all(speculative_engine(tiny_llama, drafter_of(tiny_llama, 0.01)), PROMPTS[:2], params)
    assert first == second
    assert all(len(ids) == 20 for ids in first)


# -- the acceptance rules --------------------------------------------------------------------------


def test_greedy_acceptance_keeps_drafts_up_to_the_first_mismatch_then_takes_the_targets_token() -> None:
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, plus the bonus token
    assert greedy_accept([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert greedy_accept([1, 5, 6, 7], [4, 5, 6]) == [1]


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_rejection_sampling_preserves_the_target_distribution(num_drafts: int) -> None:
    """Draw drafts from q, accept or resample: the first emitted token must follow p, not q."""
    vocab, trials = 6, 20_000
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(num_drafts + 1, vocab, generator=generator) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(num_drafts, vocab, generator=generator) * 1.5, dim=-1)
    assert (target[0] - draft[0]).abs().sum() / 2 > 0.2  # q alone would fail the check below
    counts = torch.zeros(vocab)
    pair_counts = torch.zeros(vocab, vocab)
    for _ in range(trials):
        drafts = [int(torch.multinomial(draft[i], 1, generator=generator)) for i in range(num_drafts)]
        emitted = rejection_sample(target, draft, drafts, generator)
        counts[emitted[0]] += 1
        if len(emitted) > 1:
            pair_counts[emitted[0], emitted[1]] += 1
    expected = target[0] * trials
    sigma = (trials * target[0] * (1 - target[0])).sqrt()
    assert ((counts - expected).abs() <= 4.5 * sigma + 1).all(), (counts / trials, target[0])
    # The second token, given the first was an accepted draft, follows the target's next distribution.
    # The target's p(·|prefix) is the same row whatever the first token here, so pooling over it is fair.
    seconds = pair_counts.sum(0)
    n = seconds.sum()
    assert n > 1000
    sigma2 = (n * target[1] * (1 - target[1])).sqrt()
    assert ((seconds - target[1] * n).abs() <= 4.5 * sigma2 + 1).all(), (seconds / n, target[1])


def test_k_follows_the_acceptance_rate_and_the_drafter_cost() -> None:
    assert best_num_drafts(alpha=0.9, cost_ratio=0.05, max_drafts=8) == 8
    assert best_num_drafts(alpha=0.9, cost_ratio=0.3, max_drafts=8) < 8
    assert best_num_drafts(alpha=0.5, cost_ratio=0.3, max_drafts=8) == 1
    assert best_num_drafts(alpha=0.6, cost_ratio=0.2, max_drafts=8) < best_num_drafts(0.85, 0.2, 8)
    # A round that cannot emit more than it costs is not run: drafts rejected more often than a drafter step costs.
    assert best_num_drafts(alpha=0.1, cost_ratio=0.3, max_drafts=8) == 0


def test_rounds_shrink_and_stop_as_verification_rows_cost_more() -> None:
    """Verifying k + 1 rows per sequence costs more than a plain step where extra rows are not free (int8 on
    AVX2: a fifth of a one-row forward each): fewer drafts at batch 1, none at a batch of four."""
    free_rows = best_num_drafts(alpha=0.87, cost_ratio=0.32, max_drafts=4, batch_size=4)
    assert free_rows == 4
    assert 1 <= best_num_drafts(0.87, 0.32, 4, batch_size=1, forward_cost=ForwardCost(per_row=0.2)) < free_rows
    assert best_num_drafts(0.87, 0.32, 4, batch_size=4, forward_cost=ForwardCost(per_row=0.3)) == 0


def test_a_lone_sequence_speculates_on_a_thinner_modelled_gain_than_a_batch() -> None:
    """The margin a round must promise grows with the batch up to 15 %: after one rejected draft (α ~0.74) a lone
    sequence on AVX2's costs still drafts, where a flat 15 % margin declined it; at a batch of four a better α does
    not; where extra rows are free, a batch of sixteen still does (the margin stops growing)."""
    int8 = ForwardCost(per_row=0.2)
    assert best_num_drafts(0.74, 0.33, 6, batch_size=1, forward_cost=int8) >= 1
    assert best_num_drafts(0.87, 0.33, 6, batch_size=4, forward_cost=int8) == 0
    assert best_num_drafts(0.55, 0.33, 6, batch_size=1, forward_cost=int8) == 0
    assert best_num_drafts(0.88, 0.33, 6, batch_size=16) >= 1


def test_rounds_fit_the_rows_one_pass_over_the_weights_takes() -> None:
    """Where a pass over the weights takes four rows for the price of one and each further pass costs a share of a
    forward (w8a8 through VNNI): three drafts at batch 1 (4 rows to verify: one pass), one at batch 2, none at 4."""
    cost = ForwardCost(per_pass=0.4, rows_per_pass=4)
    assert [cost(rows) for rows in (1, 4, 5, 8, 16)] == pytest.approx([1, 1, 1.4, 1.4, 2.2])
    assert best_num_drafts(0.88, 0.35, 6, batch_size=1, forward_cost=cost) == 3
    assert best_num_drafts(0.88, 0.35, 6, batch_size=2, forward_cost=cost) == 1
    assert best_num_drafts(0.88, 0.35, 6, batch_size=4, forward_cost=cost) == 0


def test_a_declined_round_brings_speculation_back_after_some_plain_steps(tiny_llama: TinyModel) -> None:
    speculator = speculative_engine(tiny_llama, drafter_of(tiny_llama, 0.0)).speculator
    assert speculator is not None
    seq = Sequence("r", PROMPTS[0], GREEDY)
    speculator._alpha = 0.1  # after a run of rejected drafts
    declined = 0
    while speculator.num_drafts([seq], max_model_len=512) == 0 and declined < 1000:
        declined += 1
    assert 10 < declined < 200


# -- configuration ---------------------------------------------------------------------------------


def test_a_tier_turns_speculation_on_by_naming_a_drafter(tmp_path: Path) -> None:
    target, drafter = tmp_path / "large.gguf", tmp_path / "small.gguf"
    target.touch()
    drafter.touch()
    spec = TierSpec(name="large", model=str(target), speculative_draft=str(drafter), num_speculative_tokens=6)
    config = spec.engine_config()
    assert config.speculative_model == str(drafter) and config.num_speculative_tokens == 6
    assert TierSpec(name="large", model=str(target)).engine_config().speculative_model is None


def test_a_drafter_with_another_vocabulary_is_refused(tiny_qwen2: TinyModel) -> None:
    checkpoint = tiny_qwen2.checkpoint
    other = Checkpoint(config=dataclasses.replace(checkpoint.config, vocab_size=checkpoint.config.vocab_size + 16),
                       tensors=checkpoint.tensors, tokenizer=checkpoint.tokenizer)
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        speculative_engine(tiny_qwen2, other)


def test_a_drafter_declined_by_a_large_batch_lags_then_catches_up_and_the_output_is_unchanged(
    tiny_qwen2: TinyModel,
) -> None:
    """Three sequences decline rounds (each verification row costing 0.2 of a forward); once two have finished,
    the third speculates again: its drafter, which skipped the decode steps meanwhile, catches up first."""
    lengths = [40, 6, 6]

    def run(engine: LLMEngine) -> tuple[list[list[int]], bool]:
        for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, lengths, strict=True)):
            engine.add_request(f"r{i}", prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens))
        outputs: dict[str, list] = {}
        lagged = False
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
            running = engine.scheduler.running
            lagged |= any(seq.num_draft_computed_tokens < seq.num_computed_tokens - 1 for seq in running)
        return [generated_ids(outputs[f"r{i}"]) for i in range(len(PROMPTS))], lagged

    expected, _ = run(make_engine(tiny_qwen2))
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, 0.02))
    assert engine.speculator is not None
    engine.speculator.forward_cost = ForwardCost(per_row=0.2)
    generated, lagged = run(engine)
    assert generated == expected
    assert lagged
    assert engine.speculator.stats.num_rounds > 0


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_drafter_scoring_only_the_first_ids_drafts_among_them_and_the_output_is_unchanged(
    tiny_qwen2: TinyModel, quantization: str | None
) -> None:
    expected = generate_all(make_engine(tiny_qwen2, quantization=quantization), PROMPTS, GREEDY)
    engine = speculative_engine(tiny_qwen2, drafter_of(tiny_qwen2, 0.02), quantization=quantization,
                                speculative_draft_vocab=256)
    assert engine.speculator is not None
    drafter = engine.speculator.runner.model
    logits = drafter.compute_logits(torch.randn(3, tiny_qwen2.checkpoint.config.hidden_size))
    assert logits.shape == (3, tiny_qwen2.checkpoint.config.vocab_size)
    assert torch.isfinite(logits[:, :256]).all() and (logits[:, 256:] == float("-inf")).all()
    assert generate_all(engine, PROMPTS, GREEDY) == expected
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_a_drafter_shares_the_weights_of_an_engine_already_serving_its_model(tmp_path: Path) -> None:
    """As `make run` loads the tiers: the large tier's drafter is the small tier's model, held once."""
    path = str(write_tiny_checkpoint(tmp_path, "qwen2"))
    config = EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=64, num_threads=1)
    small = LLMEngine(config)
    before = generate_all(small, PROMPTS[:2], GREEDY)
    vocab_size = small.model_config.vocab_size
    large = LLMEngine(dataclasses.replace(config, speculative_model=path, speculative_draft_vocab=vocab_size // 2))
    assert large.speculator is not None
    drafter = large.speculator.runner.model
    assert drafter.layers is small.model.layers and drafter.embed_tokens is small.model.embed_tokens
    # The drafter's head scores half the vocabulary; the served model's still scores all of it.
    assert drafter.lm_head.out_features == vocab_size // 2
    logits = small.model.compute_logits(torch.ones(1, small.model_config.hidden_size))
    assert logits.shape[-1] == vocab_size and torch.isfinite(logits).all()  # a cut head pads with -inf
    assert generate_all(small, PROMPTS[:2], GREEDY) == before


def test_an_engine_over_another_file_or_precision_loads_its_own_weights(tmp_path: Path) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "a", "qwen2"))
    config = EngineConfig(model=path, dtype="float32", num_kv_blocks=16, block_size=4, num_threads=1)
    first = LLMEngine(config)
    assert LLMEngine(config).model is first.model
    assert LLMEngine(dataclasses.replace(config, dtype="bfloat16")).model is not first.model
    other = str(write_tiny_checkpoint(tmp_path / "b", "qwen2"))
    assert LLMEngine(dataclasses.replace(config, model=other)).model is not first.model
