"""Weight-only int8 / int4 linears stay close to the float layer they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engines import quantization
from engines.block_manager import BlockManager
from engines.cpu_kernels import int8_gemv, w8a8_tiled
from engines.llm_engine import build_model
from engines.model_runner import ModelRunner
from engines.quantization import (
    PACKED_MAX_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    RowDispatchLinear,
    TiledW8A8Linear,
    W8A8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
    residual_rows,
    resolve_quantization,
    sum_passes,
)
from engines.sampling_params import SamplingParams
from engines.scheduler import ScheduledBatch
from engines.sequence import Sequence
from tests.engine.conftest import TinyModel
from tests.tiny_models import write_tiny_checkpoint


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.fixture
def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(256, 96, bias=True)


def test_int8_weights_reconstruct_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    weight_int8, scales = quantize_int8(weight)
    assert weight_int8.dtype == torch.int8 and scales.shape == (32,)
    assert weight_int8.abs().amax(dim=1).eq(127).all()  # each row's largest weight uses the full range
    error = (weight_int8.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all()


def test_int8_linear_matches_float(linear: nn.Linear) -> None:
    x = torch.randn(2, 5, 256)
    quantized = Int8Linear.from_linear(linear, activation_dtype=torch.float32)
    out = quantized(x)
    assert out.shape == (2, 5, 96) and out.dtype == torch.float32
    # bf16 activations + int8 weights: ~1% error; a wrong scale (even by 2x) would give >= 50 %
    assert relative_error(out, linear(x).detach()) < 0.02


def test_outputs_come_in_the_activation_dtype(linear: nn.Linear) -> None:
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = linear(x.float()).detach()
    for quantized in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, group_size=64)):
        out = quantized(x)
        assert out.dtype == torch.bfloat16 and out.shape == (3, 96)
        assert relative_error(out, expected) < 0.15


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_float(linear: nn.Linear, group_size: int) -> None:
    x = torch.randn(4, 256)
    quantized = Int4Linear.from_linear(linear, group_size=group_size, activation_dtype=torch.float32)
    out = quantized(x)
    assert out.shape == (4, 96) and out.dtype == torch.float32
    # 16 levels per group: ~8-10 % error on uniform weights; a wrong zero point or scale gives >= 30 %
    assert relative_error(out, linear(x).detach()) < 0.15


def test_int4_smaller_groups_are_more_accurate(linear: nn.Linear) -> None:
    x = torch.randn(8, 256)
    expected = linear(x).detach()
    errors = [relative_error(Int4Linear.from_linear(linear, size, torch.float32)(x), expected) for size in (32, 128)]
    assert errors[0] < errors[1]


def test_int4_rejects_unsupported_groups() -> None:
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(torch.randn(8, 256), group_size=48)
    with pytest.raises(ValueError, match="in_features"):
        quantize_int4(torch.randn(16, 96), group_size=64)
    with pytest.raises(ValueError, match="out_features"):
        quantize_int4(torch.randn(8, 128), group_size=64)


def test_bias_is_kept_and_optional() -> None:
    torch.manual_seed(0)
    with_bias = nn.Linear(128, 16)
    nn.init.constant_(with_bias.bias, 3.0)
    x = torch.zeros(1, 128)
    assert torch.allclose(Int8Linear.from_linear(with_bias, torch.float32)(x), torch.full((1, 16), 3.0))
    assert torch.allclose(Int4Linear.from_linear(with_bias, 32, torch.float32)(x), torch.full((1, 16), 3.0))
    without_bias = nn.Linear(128, 16, bias=False)
    assert Int8Linear.from_linear(without_bias).bias is None
    assert Int4Linear.from_linear(without_bias, 64, torch.float32)(x).abs().max() < 1e-2


def test_quantize_model_replaces_linears_except_skipped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64), nn.Linear(64, 10))
    x = torch.randn(4, 64)
    expected = model(x).detach()
    quantize_model(model, "int8", torch.float32, skip=lambda name: name == "3")
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    assert type(model[3]) is nn.Linear
    assert relative_error(model(x), expected) < 0.03
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantize_model(model, "int3", torch.bfloat16)


def test_int4_falls_back_to_what_the_kernel_accepts() -> None:
    model = nn.Sequential(nn.Linear(96, 16), nn.Linear(16, 32), nn.Linear(32, 8))
    quantize_model(model, "int4", torch.bfloat16, group_size=128)
    assert isinstance(model[0], Int4Linear) and model[0].group_size == 32  # 96 columns: groups of 32
    assert isinstance(model[1], Int8Linear)  # 16 columns: no int4 group fits
    assert isinstance(model[2], Int8Linear)  # 8 output rows: the int4 packing needs multiples of 16


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_quantized_tiny_model_keeps_its_predictions(tmp_path: Path, mode: str) -> None:
    from transformers import AutoModelForCausalLM

    directory = write_tiny_checkpoint(tmp_path / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids = torch.arange(1, 33).reshape(2, 16)
    with torch.no_grad():
        expected = model(input_ids).logits
        quantize_model(model, mode, torch.float32, group_size=32)
        actual = model(input_ids).logits
    assert not any(type(module) is nn.Linear for module in model.modules())
    # random tiny weights make logits nearly flat, so compare the logit vectors, not the argmax
    assert relative_error(actual, expected) < (0.25 if mode == "int4" else 0.05)


def test_row_dispatch_runs_many_rows_through_sgemm_on_the_dequantised_weight_where_the_int8_kernel_cannot(
    linear: nn.Linear,
) -> None:
    packed = Int8Linear.from_linear(linear, activation_dtype=torch.float32)
    packed.gemv = None  # no AVX2 kernel on this machine
    dispatch = RowDispatchLinear(packed)
    many = torch.randn(2, PACKED_MAX_ROWS, 256)  # 2 * PACKED_MAX_ROWS rows: a prefill chunk
    with torch.no_grad():
        assert torch.equal(dispatch(many), torch.nn.functional.linear(many, packed.dequantize(), packed.bias))
        assert relative_error(dispatch(many), linear(many)) < 0.02
    few = torch.randn(PACKED_MAX_ROWS, 256)  # a decode step
    out = dispatch(few)
    assert torch.equal(out, packed(few)) and out.dtype == torch.float32
    assert relative_error(out, linear(few).detach()) < 0.02


@pytest.mark.skipif(int8_gemv() is None, reason="the int8 kernel needs AVX2, FMA and a C compiler")
def test_row_dispatch_runs_prefill_chunks_through_the_int8_kernel_row_for_row_as_decode_steps(
    linear: nn.Linear,
) -> None:
    dispatch = RowDispatchLinear(Int8Linear.from_linear(linear, activation_dtype=torch.float32))
    prompt = torch.randn(3 * PACKED_MAX_ROWS + 5, 256)
    with torch.no_grad():
        prefilled = dispatch(prompt)
        decoded = torch.cat([dispatch(prompt[i : i + 1]) for i in range(len(prompt))])
        assert torch.equal(prefilled, decoded)
        assert relative_error(prefilled, linear(prompt)) < 0.02


def test_quantize_model_keeps_no_float_copy_of_any_weight() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    quantize_model(model, "int8", torch.float32, dequantize_many_rows=True)
    assert all(isinstance(layer, RowDispatchLinear) for layer in model)
    assert not any(tensor.dtype == torch.float32 and tensor.dim() == 2 for tensor in model.state_dict().values())
    int4 = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    quantize_model(int4, "int4", torch.float32, group_size=64, dequantize_many_rows=True)
    assert all(isinstance(layer, Int4Linear) for layer in int4)


def test_a_tied_int8_head_and_the_embedding_share_one_int8_table(tiny_qwen2: TinyModel) -> None:
    checkpoint = tiny_qwen2.checkpoint
    model = build_model(checkpoint.config, checkpoint.tensors, torch.float32, max_positions=128)
    ids = torch.tensor([3, 17, 200])
    expected = model.embed_tokens(ids)
    model.untie_lm_head()
    quantize_model(model, "int8", torch.float32, dequantize_many_rows=True)
    embedding = Int8Embedding.from_embedding(model.embed_tokens, torch.float32, tied_head=model.lm_head)
    assert embedding.weight.data_ptr() == model.lm_head.packed.weight.data_ptr()
    assert relative_error(embedding(ids), expected) < 0.01


def test_untied_head_shares_the_embedding_and_keeps_the_logits(tiny_qwen2: TinyModel) -> None:
    checkpoint = tiny_qwen2.checkpoint
    model = build_model(checkpoint.config, checkpoint.tensors, torch.float32, max_positions=128)
    hidden = torch.randn(3, checkpoint.config.hidden_size)
    tied_logits = model.compute_logits(hidden)
    model.untie_lm_head()
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.compute_logits(hidden), tied_logits)


def test_float32_model_with_row_dispatch_stays_close_to_hf_in_prefill_and_decode(tiny_model: TinyModel) -> None:
    checkpoint = tiny_model.checkpoint
    block_size = 4
    model = build_model(checkpoint.config, checkpoint.tensors, torch.float32, max_positions=128)
    model.untie_lm_head()
    quantize_model(model, "int8", torch.float32, dequantize_many_rows=True)
    dispatching = [module for module in model.modules() if isinstance(module, RowDispatchLinear)]
    assert len(dispatching) == 4 * checkpoint.config.num_hidden_layers + 1  # qkv, o, gate_up, down; the head
    runner = ModelRunner(model, checkpoint.config, block_size, num_kv_blocks=32, kv_cache_dtype=torch.float32)
    manager = BlockManager(32, block_size, enable_prefix_caching=False)
    prompt = [(7 * i + 3) % 500 for i in range(PACKED_MAX_ROWS + 12)]  # one chunk: the many-row path
    seq = Sequence("s", prompt, SamplingParams(temperature=0))
    expected_steps = 3
    for step in range(expected_steps):
        num_new = len(prompt) if step == 0 else 1  # then decode steps: the packed path
        if step == 0:
            manager.allocate(seq, [], num_new)
        else:
            manager.may_append(seq, num_new)
        logits, _, _ = runner.execute(ScheduledBatch([seq], [num_new]))
        seq.num_computed_tokens += num_new
        with torch.no_grad():
            expected = tiny_model.hf_model(torch.tensor([seq.token_ids])).logits[0, -1]
        # Prefill and decode both compute with the int8 weights (prefill through sgemm on their dequantised
        # copy), so decode's error adds to the cached context's; a wrong scale or layout gives >= 50%.
        assert relative_error(logits[0], expected) < 0.1
        seq.append_token(int(expected.argmax()))


def test_w8a8_linear_matches_float_and_each_row_ignores_its_batch_mates(linear: nn.Linear) -> None:
    x = torch.randn(6, 256)
    quantized = W8A8Linear.from_linear(linear, torch.float32)
    out = quantized(x)
    assert out.shape == (6, 96) and out.dtype == torch.float32
    # int8 weights and per-row int8 activations: ~1% error; a wrong scale (even by 2x) gives >= 50%
    assert relative_error(out, linear(x).detach()) < 0.02
    # A row with far larger activations must not coarsen the others' quantisation (per-row scales).
    loud = torch.cat([x, 1000 * torch.randn(1, 256)])
    assert torch.equal(quantized(loud)[:6], out)
    assert quantized(x.bfloat16()).dtype == torch.float32  # returns the model's activation dtype


def test_a_w8a8_input_in_two_passes_is_its_rows_then_what_their_rounding_left(linear: nn.Linear) -> None:
    x = torch.randn(5, 256)
    x[:, 7] = 60.0  # an outlier channel sets each row's scale: the other activations get few int8 levels
    one_pass, two_passes = (W8A8Linear.from_linear(linear, torch.float32, passes) for passes in (1, 2))
    exact = x @ one_pass.dequantize().t() + linear.bias.detach()  # the int8 weight, float activations
    error_one, error_two = (relative_error(layer(x), exact) for layer in (one_pass, two_passes))
    assert error_two < error_one / 20  # the second pass leaves at most 1/254 of the first one's rounding error
    rows = residual_rows(x)
    scales = x.abs().amax(dim=1, keepdim=True) / 127
    assert torch.equal(rows[:5], x) and torch.equal(rows[5:], x - torch.round(x / scales) * scales)
    # The passes are one product without the bias, summed per row, then the bias: bit for bit.
    unbiased = W8A8Linear(one_pass.weight, one_pass.scales, None, torch.float32)
    assert torch.equal(two_passes(x), sum_passes(unbiased(rows), two_passes.bias))
    assert torch.equal(two_passes(x[2:3])[0], two_passes(x)[2])  # a row ignores its batch mates


def test_only_the_layers_named_take_two_passes() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    quantize_model(model, "w8a8", torch.float32, two_pass=lambda name: name == "1")
    assert [layer.activation_passes for layer in model] == [1, 2]
    quantize_model(int8 := nn.Sequential(nn.Linear(64, 64)), "int8", torch.float32, two_pass=lambda name: True)
    assert not hasattr(int8[0], "activation_passes")  # int8 weight-only: activations are not quantised to int8


def test_auto_quantization_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantization, "has_int8_dot_product", lambda: True)
    assert resolve_quantization("auto") == "w8a8"
    monkeypatch.setattr(quantization, "has_int8_dot_product", lambda: False)
    assert resolve_quantization("auto") == "int8"
    assert resolve_quantization("none") is None and resolve_quantization(None) is None
    assert resolve_quantization("int4") == "int4"
    with pytest.raises(ValueError, match="unknown quantization mode"):
        resolve_quantization("int3")


def test_w8a8_layers_need_no_float_copy() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    quantize_model(model, "w8a8", torch.float32, dequantize_many_rows=True)
    # In tile order where the CPU has AMX or VNNI: the tiles are then the only copy of the weight.
    layer_type = TiledW8A8Linear if w8a8_tiled() is not None else W8A8Linear
    assert all(type(layer) is layer_type for layer in model)
    assert all(buffer.dtype != torch.float32 or buffer.numel() <= 128 for buffer in model.buffers())


def test_an_untied_head_is_handed_over_after_every_layer_and_before_the_embedding(tiny_llama: TinyModel) -> None:
    """Loading quantises the head as soon as it is loaded: at no time are both vocabulary-sized tables float32."""
    checkpoint = tiny_llama.checkpoint
    assert not checkpoint.config.tie_word_embeddings
    seen: list[str] = []

    def quantize(module: nn.Module) -> None:
        if hasattr(module, "lm_head"):  # the model itself
            assert module.embed_tokens.weight.is_meta  # the embedding is not loaded yet
            assert not any(isinstance(m, nn.Linear) for m in module.layers.modules())  # every layer was quantised
        seen.append("head" if hasattr(module, "lm_head") else "layer")
        quantize_model(module, "int8", torch.float32)

    model = build_model(checkpoint.config, dict(checkpoint.tensors), torch.float32, max_positions=128,
                        on_layer_loaded=quantize)
    assert seen == ["layer"] * checkpoint.config.num_hidden_layers + ["head"]
    assert isinstance(model.lm_head, Int8Linear) and not model.embed_tokens.weight.is_meta


def test_int8_quantisation_in_row_blocks_equals_quantising_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(300, 64)
    monkeypatch.setattr(quantization, "_QUANTIZE_ROWS", 7)  # many blocks and a ragged last one
    weight_int8, scales = quantize_int8(weight)
    expected_scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    assert torch.equal(scales, expected_scales)
    assert torch.equal(weight_int8, torch.round(weight / expected_scales[:, None]).clamp(-128, 127).to(torch.int8))
