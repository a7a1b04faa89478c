"""The engine's CUDA path, exercised on the CPU: a model runner whose attention layer calls the Triton kernels
(K/V store and paged decode attention) and whose projections are the CUDA int8 layers (`TritonInt8Linear`), run
by Triton's interpreter, computes the same logits as the PyTorch path over the same spans: prompts in chunks
(the second over a cached prefix), then decode steps of two sequences with different lengths.

`@triton.jit` reads TRITON_INTERPRET at import time, so the runs happen in one subprocess with it set.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine.interpreted import interpreted_report, report_when_run

BLOCK_SIZE = 4


def tiny_model() -> torch.nn.Module:
    from engines.config import ModelConfig
    from engines.models.llama import LlamaForCausalLM

    config = ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64, attention_bias=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        for parameter in model.parameters():  # biases and norms too: nothing the kernels could get away without
            parameter.data.normal_(0, 0.3)
    return model.eval()


def run_spans(model: torch.nn.Module, triton: bool) -> list[torch.Tensor]:
    """Logits of: A's prompt in two chunks and B's prompt (one step), then three decode steps of A and B."""
    from engines.model_runner import ModelRunner, TokenSpan

    runner = ModelRunner(model, model.config, BLOCK_SIZE, num_kv_blocks=12, kv_cache_dtype=torch.float32,
                         triton_attention=triton)
    table_a, table_b = [7, 2, 9, 4], [5, 0, 11]  # shuffled physical blocks
    a, b = [3, 14, 15, 92, 65, 35, 8, 9, 79], [2, 71, 82, 81]
    logits = [runner.forward([TokenSpan(a[:6], 0, table_a)]),
              runner.forward([TokenSpan(a[6:], 6, table_a), TokenSpan(b, 0, table_b)])]
    for step in range(3):
        logits.append(runner.forward([TokenSpan([10 + step], len(a) + step, table_a),
                                      TokenSpan([20 + step], len(b) + step, table_b)]))
    return logits


def dequantised_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model with each projection's weight replaced by its int8 round trip (what the int8 layers compute with)."""
    from engines.quantization import quantize_int8

    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            weight_int8, scales = quantize_int8(module.weight.detach())
            module.weight.data = weight_int8.float() * scales[:, None]
    return reference


def max_error(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, reference, strict=True))


def interpreted_errors_of_runs() -> dict[str, float]:
    from engines.quantization import quantize_model

    model = tiny_model()
    attention = max_error(run_spans(model, triton=True), run_spans(model, triton=False))
    int8 = copy.deepcopy(model)
    quantize_model(int8, "int8", torch.float32, device_type="cuda")  # the CUDA layers, run here interpreted
    assert type(int8.layers[0].mlp.down_proj).__name__ == "TritonInt8Linear"
    quantized = max_error(run_spans(int8, triton=True), run_spans(dequantised_copy(model), triton=False))
    return {"attention": attention, "int8": quantized}


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return interpreted_report(__file__)


def test_the_triton_attention_path_computes_the_pytorch_paths_logits(errors: dict[str, float]) -> None:
    assert errors["attention"] < 1e-4


def test_the_cuda_int8_layers_compute_with_the_int8_weights(errors: dict[str, float]) -> None:
    assert errors["int8"] < 1e-3


def test_the_reference_runs_differ_when_the_weights_do() -> None:
    """The comparison above can fail: an int8 round trip moves the logits by far more than its tolerance."""
    model = tiny_model()
    assert max_error(run_spans(dequantised_copy(model), triton=False), run_spans(model, triton=False)) > 1e-2


if __name__ == "__main__":
    # The subprocess side of the fixture: TRITON_INTERPRET=1 is already in the environment.
    report_when_run(interpreted_errors_of_runs)
