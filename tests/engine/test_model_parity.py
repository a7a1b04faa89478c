"""Our Llama/Qwen2 implementation computes what HF transformers computes, on the same weights."""

from __future__ import annotations

import pytest
import torch

from engines.block_manager import BlockManager
from engines.llm_engine import build_model
from engines.model_runner import ModelRunner
from engines.sampling_params import SamplingParams
from engines.scheduler import ScheduledBatch
from engines.sequence import Sequence
from tests.engine.conftest import SMOLLM2_GGUF, TinyModel, generated_ids, make_engine, run_to_completion

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [300, 301, 302], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def hf_last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


def test_logits_match_hf_for_prefill_chunked_prefill_and_decode(tiny_model: TinyModel) -> None:
    checkpoint = tiny_model.checkpoint
    block_size = 4
    model = build_model(checkpoint.config, checkpoint.tensors, torch.float32, max_positions=128)
    runner = ModelRunner(model, checkpoint.config, block_size, num_kv_blocks=32, kv_cache_dtype=torch.float32)
    manager = BlockManager(32, block_size, enable_prefix_caching=False)
    seqs = [Sequence(f"s{i}", prompt, SamplingParams(temperature=0)) for i, prompt in enumerate(PROMPTS)]

    # Step 1: the first two prompts whole, the third only its first 6 tokens (a chunk).
    first_chunk = [len(PROMPTS[0]), len(PROMPTS[1]), 6]
    for seq, num_new in zip(seqs, first_chunk, strict=True):
        manager.allocate(seq, [], num_new)
    logits, sampled, _ = runner.execute(ScheduledBatch(seqs, first_chunk))
    for seq, num_new in zip(seqs, first_chunk, strict=True):
        seq.num_computed_tokens += num_new
    assert sampled == seqs[:2]
    for row, seq in enumerate(sampled):
        torch.testing.assert_close(logits[row], hf_last_logits(tiny_model.hf_model, seq.token_ids), atol=1e-4, rtol=0)

    # Step 2: two decodes and the rest of the third prompt, attending over its cached first chunk.
    for seq, row in zip(seqs[:2], range(2), strict=True):
        seq.append_token(int(logits[row].argmax()))
    second = [1, 1, len(PROMPTS[2]) - 6]
    for seq, num_new in zip(seqs, second, strict=True):
        manager.may_append(seq, num_new)
    logits, sampled, _ = runner.execute(ScheduledBatch(seqs, second))
    assert sampled == seqs
    for row, seq in enumerate(sampled):
        torch.testing.assert_close(logits[row], hf_last_logits(tiny_model.hf_model, seq.token_ids), atol=1e-4, rtol=0)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_greedy_output_is_token_identical_to_hf_generate(tiny_model: TinyModel, batched: bool) -> None:
    engine = make_engine(tiny_model, max_num_batched_tokens=8)  # prompts are prefilled in several chunks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS if batched else PROMPTS[:1]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(tiny_model.hf_model, prompt, 24)
        assert len(set(expected)) > 3, "the reference output should not be degenerate"
        assert generated_ids(outputs[f"r{i}"]) == expected


def test_smollm2_gguf_greedy_matches_hf_on_the_same_weights() -> None:
    if not SMOLLM2_GGUF.exists():
        pytest.skip(f"demo model {SMOLLM2_GGUF} is absent (fetch it with `sluice models fetch`)")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engines.config import EngineConfig
    from engines.llm_engine import LLMEngine
    from engines.loader import load_checkpoint

    checkpoint = load_checkpoint(SMOLLM2_GGUF)
    config = checkpoint.config
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf_model.load_state_dict(checkpoint.tensors, strict=not config.tie_word_embeddings)
    hf_model.eval()

    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(model=str(SMOLLM2_GGUF), dtype="float32",
                                                                num_kv_blocks=64, max_model_len=512, num_threads=1))
    messages = [[{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Write a haiku about the sea."}]]
    prompts = [checkpoint.tokenizer.apply_chat_template(m) for m in messages]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert generated_ids(outputs[f"r{i}"]) == hf_greedy(hf_model, prompt, 16)
