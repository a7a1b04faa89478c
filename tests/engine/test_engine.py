"""LLMEngine behaviour: batching and caching never change results, requests end cleanly, nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.cpu_kernels import w8a8_tiled
from engines.llm_engine import LLMEngine
from engines.sampler import GreedyTokens
from engines.sampling_params import SamplingParams
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11]


def assert_no_blocks_held(engine: LLMEngine) -> None:
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)
    assert not engine.has_unfinished_requests()


def greedy_alone(model: TinyModel, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = make_engine(model, enable_prefix_caching=False)
    engine.add_request("alone", prompt, params)
    return generated_ids(run_to_completion(engine)["alone"])


def test_greedy_output_does_not_depend_on_the_rest_of_the_batch(tiny_llama: TinyModel) -> None:
    alone = greedy_alone(tiny_llama, PROMPT)
    engine = make_engine(tiny_llama, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine.add_request("early", list(range(30, 60)), GREEDY)
    engine.step()  # "early" is mid-prefill when ours arrives
    engine.add_request("ours", PROMPT, GREEDY)
    engine.add_request("late", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert generated_ids(outputs["ours"]) == alone


def test_greedy_output_does_not_depend_on_the_prefix_coming_from_the_cache(tiny_qwen2: TinyModel) -> None:
    shared = list(range(100, 123))  # 5 full blocks of 4, then 3 more tokens
    prompt = [*shared, 7, 8, 9]
    engine = make_engine(tiny_qwen2)
    engine.add_request("warm", [*shared, 1], GREEDY)
    run_to_completion(engine)
    engine.add_request("ours", prompt, GREEDY)
    outputs = run_to_completion(engine)["ours"]
    assert outputs[0].num_cached_tokens == 20
    assert generated_ids(outputs) == greedy_alone(tiny_qwen2, prompt)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 20
    assert stats.prefix_cache_queries_tokens == len(shared) + 1 + len(prompt)


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_a_bfloat16_kv_cache_and_w8a8_weights_keep_outputs_independent_of_cache_and_batch(
    tiny_qwen2: TinyModel, quantization: str | None
) -> None:
    settings = {"kv_cache_dtype": "bfloat16", "quantization": quantization}
    shared = list(range(100, 123))
    prompt = [*shared, 7, 8, 9]
    alone = make_engine(tiny_qwen2, enable_prefix_caching=False, **settings)
    assert alone.runner.kv_caches[0][0].dtype == torch.bfloat16
    alone.add_request("alone", prompt, GREEDY)
    expected = generated_ids(run_to_completion(alone)["alone"])

    engine = make_engine(tiny_qwen2, max_num_batched_tokens=16, **settings)
    engine.add_request("warm", [*shared, 1], GREEDY)
    run_to_completion(engine)
    engine.add_request("other", list(range(30, 60)), GREEDY)
    engine.step()
    engine.add_request("ours", prompt, GREEDY)
    outputs = run_to_completion(engine)
    assert outputs["ours"][0].num_cached_tokens == 20
    assert generated_ids(outputs["ours"]) == expected


def test_greedy_steps_take_the_lm_heads_argmax_and_choose_what_sampling_the_logits_chooses(
    tiny_qwen2: TinyModel,
) -> None:
    """Where every row of a step is plain greedy, the step asks the model for its argmax ids (on AMX or VNNI a w8a8 LM
    head compares its outputs in cache and writes no logits), and for the chosen tokens' logprobs where a row asks
    (the cascade's confidence: folded into the same pass); a request that asks for top logprobs goes through the
    logits and `sample`, and gets the same tokens and chosen logprobs."""
    engine = make_engine(tiny_qwen2, quantization="w8a8", enable_prefix_caching=False)
    model = engine.runner.model
    from_head: list[bool] = []  # per greedy step: whether the LM head gave the ids
    head_argmax = model.greedy_tokens

    def spy(hidden: torch.Tensor, with_logprobs: bool = False) -> GreedyTokens | None:
        chosen = head_argmax(hidden, with_logprobs)
        from_head.append(chosen is not None)
        return chosen

    model.greedy_tokens = spy  # type: ignore[method-assign]
    prompt = list(range(40, 61))
    engine.add_request("plain", prompt, GREEDY)
    plain = run_to_completion(engine)["plain"]
    assert len(from_head) == GREEDY.max_tokens
    assert all(from_head) == (w8a8_tiled() is not None)  # elsewhere: the argmax of the logits
    chosen_only = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=True)
    engine.add_request("chosen", prompt, chosen_only)
    chosen = run_to_completion(engine)["chosen"]
    assert len(from_head) == 2 * GREEDY.max_tokens  # greedy steps still, logprobs and all
    with_top = dataclasses.replace(chosen_only, top_logprobs=1)
    engine.add_request("top", prompt, with_top)
    top = run_to_completion(engine)["top"]
    assert len(from_head) == 2 * GREEDY.max_tokens  # that request's steps read the logits
    assert generated_ids(chosen) == generated_ids(top) == generated_ids(plain)
    chosen_logprobs = [lp.logprob for output in chosen for lp in output.logprobs]
    top_logprobs = [lp.logprob for output in top for lp in output.logprobs]
    assert all(lp.top == [] for output in chosen for lp in output.logprobs)
    assert chosen_logprobs == pytest.approx(top_logprobs, abs=2e-5)
    assert chosen_logprobs != pytest.approx([0.0] * len(chosen_logprobs), abs=1e-3)  # a tiny model's are not ~0


def test_an_identical_prompt_hits_all_but_its_last_block(tiny_qwen2: TinyModel) -> None:
    engine = make_engine(tiny_qwen2)
    prompt = list(range(200, 216))  # 4 full blocks
    engine.add_request("first", prompt, GREEDY)
    first = run_to_completion(engine)["first"]
    engine.add_request("second", prompt, GREEDY)
    second = run_to_completion(engine)["second"]
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 12
    assert generated_ids(second) == generated_ids(first)


def test_preemption_under_memory_pressure_changes_no_output_and_leaks_no_block(tiny_llama: TinyModel) -> None:
    prompts = {f"r{i}": [10 * i + j for j in range(6 + i)] for i in range(4)}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = {name: greedy_alone(tiny_llama, prompt, params) for name, prompt in prompts.items()}
    engine = make_engine(tiny_llama, num_kv_blocks=12, enable_prefix_caching=False)  # 4 x 8 blocks wanted
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    assert engine.stats().num_preempted_total > 0
    assert {name: generated_ids(out) for name, out in outputs.items()} == expected
    assert_no_blocks_held(engine)


def test_incremental_text_adds_up_to_the_decoded_output(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama)
    prompt = engine.tokenizer.encode("The quick brown fox")
    engine.add_request("r", prompt, GREEDY)
    outputs = run_to_completion(engine)["r"]
    assert "".join(o.new_text for o in outputs) == engine.tokenizer.decode(generated_ids(outputs))
    assert [o.num_output_tokens for o in outputs] == list(range(1, 21))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert not any(o.finished for o in outputs[:-1])


def test_a_stop_string_ends_the_request_and_is_not_part_of_the_text(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama)
    prompt = engine.tokenizer.encode("Hello, world!")
    engine.add_request("free", prompt, GREEDY)
    full_text = "".join(o.new_text for o in run_to_completion(engine)["free"])
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    assert len(stop) == 3
    engine.add_request("stopped", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    outputs = run_to_completion(engine)["stopped"]
    assert "".join(o.new_text for o in outputs) == full_text[:full_text.index(stop)]
    assert outputs[-1].finish_reason == "stop"
    assert_no_blocks_held(engine)


def test_stop_token_ids_and_eos_end_the_request(tiny_llama: TinyModel) -> None:
    free = greedy_alone(tiny_llama, PROMPT)
    stop_token = free[4]
    engine = make_engine(tiny_llama)
    engine.add_request("stop-id", PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]))
    outputs = run_to_completion(engine)["stop-id"]
    assert generated_ids(outputs) == free[:free.index(stop_token) + 1]
    assert outputs[-1].finish_reason == "stop"

    engine.scheduler.eos_token_ids = frozenset({stop_token})
    engine.add_request("eos", PROMPT, SamplingParams(temperature=0, max_tokens=20))
    assert generated_ids(run_to_completion(engine)["eos"]) == free[:free.index(stop_token) + 1]
    engine.add_request("ignore-eos", PROMPT, GREEDY)
    assert generated_ids(run_to_completion(engine)["ignore-eos"]) == free
    assert_no_blocks_held(engine)


def test_aborted_requests_free_their_blocks_and_others_finish(tiny_qwen2: TinyModel) -> None:
    engine = make_engine(tiny_qwen2)
    for i in range(5):
        engine.add_request(f"r{i}", [3 * i + j for j in range(9)], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("r1")
    engine.abort_request("r4")
    engine.abort_request("unknown")  # ignored
    outputs = run_to_completion(engine)
    assert sorted(name for name, out in outputs.items() if out[-1].finished) == ["r0", "r2", "r3"]
    assert_no_blocks_held(engine)


def test_a_seeded_request_samples_the_same_tokens_whatever_the_batch(tiny_llama: TinyModel) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = greedy_alone(tiny_llama, PROMPT, params)
    engine = make_engine(tiny_llama)
    engine.add_request("other", [1, 2, 3, 4], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    engine.add_request("ours", PROMPT, params)
    outputs = run_to_completion(engine)
    assert generated_ids(outputs["ours"]) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert greedy_alone(tiny_llama, PROMPT, other_seed) != alone


def test_logprobs_come_from_the_model_distribution(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=3, logprobs=True, top_logprobs=5, ignore_eos=True)
    engine.add_request("r", PROMPT, params)
    first = run_to_completion(engine)["r"][0]
    with torch.no_grad():
        expected = torch.log_softmax(tiny_llama.hf_model(torch.tensor([PROMPT])).logits[0, -1], dim=-1)
    (logprob,) = first.logprobs
    assert logprob.token_id == first.new_token_ids[0]
    assert logprob.logprob == pytest.approx(expected[logprob.token_id].item(), abs=1e-4)
    top_values, top_ids = expected.topk(5)
    assert [token_id for token_id, _ in logprob.top] == top_ids.tolist()
    assert [value for _, value in logprob.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token_across_chunks_and_cached_prefixes(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama)  # 64-token chunks: this prompt takes three
    prompt = [(7 * i) % 400 + 10 for i in range(150)]
    with torch.no_grad():
        expected = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0], dim=-1)
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    plain = generated_ids(run_to_completion(engine)["plain"])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    for request_id in ("scored", "again"):  # the prompt is in the prefix cache now: it is computed again all the same
        engine.add_request(request_id, prompt, params)
        outputs = run_to_completion(engine)[request_id]
        assert generated_ids(outputs) == plain
        scored = outputs[0].prompt_logprobs
        assert all(output.prompt_logprobs is None for output in outputs[1:])
        assert scored[0] is None and len(scored) == len(prompt)
        for position, logprob in enumerate(scored[1:]):  # position p's logits score token p + 1
            assert logprob.token_id == prompt[position + 1]
            assert logprob.logprob == pytest.approx(expected[position, prompt[position + 1]].item(), abs=1e-4)
            assert [token_id for token_id, _ in logprob.top] == expected[position].topk(3).indices.tolist()
    engine.add_request("one", prompt[:1], params)
    assert run_to_completion(engine)["one"][0].prompt_logprobs == [None]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 100_000], SamplingParams(), "token ids must be in"),
        (list(range(500)), SamplingParams(max_tokens=20), "maximum context length is 512"),
        (list(range(200)), SamplingParams(max_tokens=100), "KV-cache blocks"),
    ],
)
def test_requests_that_can_never_be_served_are_refused_clearly(
        tiny_llama: TinyModel, prompt: list[int], params: SamplingParams, message: str) -> None:
    engine = make_engine(tiny_llama, num_kv_blocks=64)  # 64 blocks of 4 tokens: 256 tokens at most
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()


def test_a_request_id_cannot_be_used_twice_at_once(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("same", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", PROMPT, GREEDY)


def test_stats_report_the_cache_and_the_queues(tiny_llama: TinyModel) -> None:
    engine = make_engine(tiny_llama, num_kv_blocks=32, max_num_seqs=1)
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", PROMPT, GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_blocks_total == 32
    assert stats.kv_blocks_used == 3  # 11 prompt tokens in blocks of 4
    assert stats.kv_blocks_used + stats.kv_blocks_free == 32
    assert stats.num_generated_tokens_total == 1
    run_to_completion(engine)
    assert engine.stats().num_generated_tokens_total == 40


def test_the_kv_cache_dtype_follows_the_setting_and_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines import llm_engine
    from engines.llm_engine import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(None, torch.float32) is torch.float32  # the library default: the activations'
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    monkeypatch.setattr(llm_engine, "has_native_bf16", lambda: True)
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.bfloat16
    monkeypatch.setattr(llm_engine, "has_native_bf16", lambda: False)
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp8", torch.float32)


@pytest.mark.parametrize(("device", "message"), [("tpu", "expected 'cpu' or 'cuda"),
                                                 (f"cuda:{torch.cuda.device_count()}", "no such CUDA device")])
def test_a_device_the_engine_cannot_use_is_refused_clearly(tiny_qwen2: TinyModel, device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_qwen2, device=device)


def test_quantisation_modes_that_do_not_run_on_cuda_are_refused_there() -> None:
    from engines.quantization import resolve_quantization

    with pytest.raises(ValueError, match="does not run on CUDA"):
        resolve_quantization("w8a8", "cuda")
    assert resolve_quantization("auto", "cuda") is None  # bfloat16 weights: the faster ones on the H200 measured
    assert resolve_quantization("int8", "cuda") == "int8"
