"""The engine on CUDA (skipped without a GPU; `bench/gpu.sh` runs it on a lent GPU machine, where it needs no
conftest: `pytest --noconftest`).

Float32 on the GPU (the Triton kernels, CUDA graphs, TF32 off) decodes the same greedy tokens as the CPU path;
graphs and eager steps agree; bfloat16 with int8 or fp8 weights runs; greedy speculative decoding on CUDA emits
plain decoding's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.config import EngineConfig
from engines.llm_engine import LLMEngine
from engines.loader import Checkpoint, load_checkpoint
from engines.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 7, 300, 12], [100, 200, 300, 400, 500, 11, 12, 13, 14]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The tiny qwen2 test model (tied head, q/k/v biases), weights redrawn wide enough that greedy decoding
    walks through varied tokens."""
    from tests.tiny_models import write_tiny_checkpoint

    loaded = load_checkpoint(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2"))
    generator = torch.Generator().manual_seed(1234)
    tensors = {name: (1.0 + 0.1 * torch.randn(t.shape, generator=generator)) if name.endswith("norm.weight")
               else 0.25 * torch.randn(t.shape, generator=generator) for name, t in loaded.tensors.items()}
    return Checkpoint(loaded.config, tensors, loaded.tokenizer)


def generate(checkpoint: Checkpoint, drafter: Checkpoint | None = None, **overrides: object) -> list[list[int]]:
    settings: dict[str, object] = dict(model="tiny", dtype="float32", device="cuda", num_kv_blocks=64, block_size=4,
                                       max_num_seqs=8, max_num_batched_tokens=64)
    settings.update(overrides)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(**settings), drafter=drafter)  # type: ignore[arg-type]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def test_float32_on_cuda_decodes_the_cpu_paths_tokens(checkpoint: Checkpoint) -> None:
    cpu = generate(checkpoint, device="cpu", num_threads=1)
    assert generate(checkpoint) == cpu  # CUDA graphs for the decode steps
    assert generate(checkpoint, cuda_graph_max_batch=0) == cpu  # every step eager


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_bfloat16_with_quantised_weights_runs_on_cuda(checkpoint: Checkpoint, quantization: str | None) -> None:
    from engines.quantization import FP8_MIN_CAPABILITY

    if quantization == "fp8" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    outputs = generate(checkpoint, dtype="bfloat16", quantization=quantization)
    assert [len(tokens) for tokens in outputs] == [MAX_TOKENS] * len(PROMPTS)
    assert all(0 <= token < checkpoint.config.vocab_size for tokens in outputs for token in tokens)


def test_greedy_speculative_decoding_on_cuda_emits_plain_decodings_tokens(checkpoint: Checkpoint) -> None:
    plain = generate(checkpoint)
    assert generate(checkpoint, drafter=checkpoint, speculative_model="self") == plain

