"""The engine's CUDA path, exercised on the CPU: a model runner whose attention layer calls the Triton kernels
(K/V store and paged decode attention) and whose projections are the CUDA int8 layers (`TritonInt8Linear`), run
by Triton's interpreter, computes the same logits as the PyTorch path over the same spans: prompts in chunks
(the second over a cached prefix), then decode steps of two sequences with different lengths.

It also counts the kernels a decode layer launches on each path: on a GPU that count, not the weights' bytes,
sets a decode step's time (BENCHMARKS.md).

`@triton.jit` reads TRITON_INTERPRET at import time, so the runs happen in one subprocess with it set.
"""

from __future__ import annotations

import copy
from unittest import mock

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


def kernels_per_layer(triton: bool) -> float:
    """Kernels a decoder layer launches in a decode step of two sequences: PyTorch ops that compute (views,
    allocations and conversions that return their input launch nothing) plus Triton launches (the interpreter's
    own tensor work inside a launch is not counted). On a GPU a decode step is bound by this count."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from engines.model_runner import ModelRunner, TokenSpan
    from engines.models.llama import DecoderLayer

    no_launch = {"view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "t", "transpose",
                 "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach", "permute", "empty", "empty_like",
                 "empty_strided", "lift_fresh"}
    maybe_no_launch = {"to", "reshape", "contiguous"}  # a kernel only when they copy
    count = {"kernels": 0, "layers": 0, "in_layer": 0, "in_launch": 0}

    def counting() -> bool:
        return count["in_layer"] > 0 and count["in_launch"] == 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            result = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            copied = name not in maybe_no_launch or result.data_ptr() != args[0].data_ptr()
            if counting() and name not in no_launch and copied:
                count["kernels"] += 1
            return result

    def entered(method, where: str):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            if where == "in_layer":
                count["layers"] += 1
            elif counting():
                count["kernels"] += 1  # a Triton launch from a layer
            count[where] += 1
            try:
                return method(*args, **kwargs)
            finally:
                count[where] -= 1
        return wrapped

    model = tiny_model()
    runner = ModelRunner(model, model.config, BLOCK_SIZE, num_kv_blocks=12, kv_cache_dtype=torch.float32,
                         triton_attention=triton)
    runner.forward([TokenSpan([3, 14, 15, 92], 0, [7, 2]), TokenSpan([2, 71], 0, [5])])
    name = "forward_fused" if triton else "forward"
    layer_forward, launch = getattr(DecoderLayer, name), InterpretedFunction.run
    try:
        setattr(DecoderLayer, name, entered(layer_forward, "in_layer"))
        InterpretedFunction.run = entered(launch, "in_launch")
        # On a GPU the PyTorch path's norms are torch ops, not the CPU kernel they are on this machine.
        with Count(), mock.patch("engines.models.llama.rms_norm_rows", return_value=None):
            runner.forward([TokenSpan([10], 4, [7, 2]), TokenSpan([20], 2, [5])])
    finally:
        setattr(DecoderLayer, name, layer_forward)
        InterpretedFunction.run = launch
    return count["kernels"] / count["layers"]


def interpreted_errors_of_runs() -> dict[str, float]:
    from engines.quantization import quantize_model

    model = tiny_model()
    attention = max_error(run_spans(model, triton=True), run_spans(model, triton=False))
    int8 = copy.deepcopy(model)
    quantize_model(int8, "int8", torch.float32, device_type="cuda")  # the CUDA layers, run here interpreted
    assert type(int8.layers[0].mlp.down_proj).__name__ == "TritonInt8Linear"
    quantized = max_error(run_spans(int8, triton=True), run_spans(dequantised_copy(model), triton=False))
    return {"attention": attention, "int8": quantized, "kernels_per_layer_triton": kernels_per_layer(True),
            "kernels_per_layer_pytorch": kernels_per_layer(False)}


@pytest.fixture(scope="module")
def figures() -> dict[str, float]:
    return interpreted_report(__file__)


def test_the_triton_attention_path_computes_the_pytorch_paths_logits(figures: dict[str, float]) -> None:
    assert figures["attention"] < 1e-4


def test_the_cuda_int8_layers_compute_with_the_int8_weights(figures: dict[str, float]) -> None:
    assert figures["int8"] < 1e-3


def test_a_decode_layer_on_the_cuda_path_launches_nine_kernels(figures: dict[str, float]) -> None:
    """A GPU decode step is bound by how many kernels it launches (BENCHMARKS.md): two fused norms, the q/k/v
    product, RoPE with the K/V store, the attention, the o product, gate/up, SiLU · up, down."""
    assert figures["kernels_per_layer_triton"] <= 9
    # the count sees what fusion saved: the PyTorch path's layer launches more than twice as many
    assert figures["kernels_per_layer_pytorch"] > 2 * figures["kernels_per_layer_triton"]


def test_the_reference_runs_differ_when_the_weights_do() -> None:
    """The comparison above can fail: an int8 round trip moves the logits by far more than its tolerance."""
    model = tiny_model()
    assert max_error(run_spans(dequantised_copy(model), triton=False), run_spans(model, triton=False)) > 1e-2


if __name__ == "__main__":
    # The subprocess side of the fixture: TRITON_INTERPRET=1 is already in the environment.
    report_when_run(interpreted_errors_of_runs)
