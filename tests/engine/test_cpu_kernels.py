"""The CPU decode kernels compute what the PyTorch paths do (the w8a8 one bit for bit, the int8 one bit for
bit what its int16 activations and exact sums say, within bfloat16 of the packed op), and their absence costs
nothing but speed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines import cpu_kernels
from engines.attention import AttentionMetadata, paged_attention
from engines.config import ModelConfig
from engines.cpu_kernels import PagedDecodeAttention, TiledW8A8Kernel, int8_gemv, w8a8_amx, w8a8_vnni
from engines.model_runner import ModelRunner, TokenSpan
from engines.models.llama import MLP, LlamaForCausalLM, RMSNorm, rope_cos_sin
from engines.quantization import (
    PACKED_MAX_ROWS,
    Int8Embedding,
    Int8Linear,
    RowDispatchLinear,
    TiledW8A8Linear,
    W8A8Linear,
    first_output_rows,
)

needs_vnni = pytest.mark.skipif(
    w8a8_vnni() is None, reason="the VNNI w8a8 kernel needs AVX-512 VNNI and a C compiler; this machine lacks one"
)
needs_amx = pytest.mark.skipif(
    w8a8_amx() is None, reason="the AMX w8a8 kernel needs AMX-INT8 (e.g. Intel Sapphire Rapids); this CPU lacks it"
)
needs_library = pytest.mark.skipif(
    int8_gemv() is None, reason="the CPU decode kernels need AVX2, FMA and a C compiler; this machine lacks one"
)
# Every build of the attention kernel this CPU runs (AVX-512 CPUs run the AVX2 one too).
ATTENTION_ISAS = ["avx2", *(["avx512"] if w8a8_vnni() is not None else []),
                  *(["avx512bf16"] if w8a8_vnni() is not None and cpu_kernels.bf16_dot_products() else []),
                  *(["amx"] if cpu_kernels.attention_isa() == "amx" else [])]
# The two products over a weight in tile order, each where this CPU runs it.
TILED_KERNELS = [pytest.param("amx", marks=needs_amx), pytest.param("vnni", marks=needs_vnni)]


def layer_pair(layer_type: type[Int8Linear], in_features: int, out_features: int, bias: bool
               ) -> tuple[Int8Linear, Int8Linear]:  # fmt: skip
    """The same quantised layer twice: through its kernel, and forced onto its PyTorch op (the packed bfloat16
    `_weight_int8pack_mm` for int8)."""
    torch.manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # a scale of its own for each output feature (nn.Linear's rows share nearly one)
        linear.weight.mul_(torch.linspace(0.5, 2.0, out_features).unsqueeze(1))
    with_kernel = layer_type.from_linear(linear, torch.float32)
    reference = layer_type.from_linear(linear, torch.float32)
    reference.gemv = None
    return with_kernel, reference


def tiled_kernel(kernel_name: str) -> TiledW8A8Kernel:
    kernel = {"amx": w8a8_amx, "vnni": w8a8_vnni}[kernel_name]()
    assert kernel is not None
    return kernel


def tiled_pair(kernel_name: str, in_features: int, out_features: int, bias: bool, activation_passes: int = 1
               ) -> tuple[TiledW8A8Linear, W8A8Linear]:  # fmt: skip
    """One quantised layer in tile order on `kernel_name`'s product, and as W8A8Linear on `torch._int_mm`."""
    kernel = tiled_kernel(kernel_name)
    torch.manual_seed(in_features + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    return (TiledW8A8Linear.from_linear(linear, torch.float32, kernel, activation_passes),
            W8A8Linear.from_linear(linear, torch.float32, activation_passes))


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 37])  # blocks of 4 rows (VNNI) and 16 (AMX), and the rest
# 200, 608, 4200: padded to whole 64-input chunks; 8960: the large tier's down projection
@pytest.mark.parametrize(("in_features", "bias"), [(256, False), (200, True), (4864 // 8, True), (8960, True),
                                                   (4200, False)])
@pytest.mark.parametrize("out_features", [128, 37])  # 37: one group, padded; 128: two, one per thread
def test_the_tiled_kernels_are_bit_identical_to_int_mm(kernel_name: str, rows: int, in_features: int, bias: bool,
                                                       out_features: int) -> None:
    tiled, reference = tiled_pair(kernel_name, in_features, out_features, bias)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows).unsqueeze(1)  # row scales far apart
    x[0] = x[0].clamp(-100, 100)
    x[0, :3] = torch.tensor([127.0, 2.5, -3.5])  # scale exactly 1: two values halfway, rounded half to even
    out = torch.full((rows, out_features), float("nan"))
    out.copy_(tiled(x))  # a fresh result, compared whole: an unwritten element would not be equal
    assert torch.equal(out, reference(x))
    assert torch.equal(tiled(torch.zeros(rows, in_features)), reference(torch.zeros(rows, in_features)))


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize(("in_features", "bias"), [(256, False), (200, True)])
def test_an_input_in_two_passes_is_the_same_bits_on_the_tiled_kernels(kernel_name: str, rows: int, in_features: int,
                                                                      bias: bool) -> None:
    tiled, reference = tiled_pair(kernel_name, in_features, 96, bias, activation_passes=2)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[:, 1] *= 50  # an outlier channel
    out = torch.full((rows, 96), float("nan"))
    out.copy_(tiled(x))
    assert torch.equal(out, reference(x))
    assert not torch.equal(out, tiled_pair(kernel_name, in_features, 96, bias)[0](x))  # not one pass


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 17, 33])
@pytest.mark.parametrize(("out_features", "bias"), [(1000, True), (4096, False), (37, False)])
def test_the_tiled_argmax_picks_the_ids_numpy_picks_from_the_outputs(kernel_name: str, rows: int, out_features: int,
                                                                     bias: bool) -> None:
    """Each row's argmax of the product without writing it (an LM head's greedy choice): the ids `argmax_ids` picks
    from the outputs; of equal maxima the first (a weight row repeated in its own group, a later one and the other
    thread's half), NaN counting as the maximum."""
    from engines.sampler import argmax_ids

    kernel = tiled_kernel(kernel_name)
    torch.manual_seed(out_features + rows)
    linear = nn.Linear(896, out_features, bias=bias)
    # 19, 259 and 515 share feature 3's lane of 16 (in its group, a later one, the other thread's half); 40, 500 not
    repeats = [i for i in (19, 40, 259, 500, 515, out_features - 1) if 3 < i < out_features]
    with torch.no_grad():
        for i in repeats:
            linear.weight[i] = linear.weight[3]
            if bias:
                linear.bias[i] = linear.bias[3]
    tiled = TiledW8A8Linear.from_linear(linear, torch.float32, kernel)
    x = torch.randn(rows, 896)
    x[0] = linear.weight[3].detach() * 10  # peaks at feature 3 and its repeats
    chosen = tiled.argmax(x)
    assert chosen is not None
    ids, logprobs = chosen
    assert torch.equal(ids, argmax_ids(tiled(x))) and logprobs is None
    assert ids[0].item() == 3 and torch.equal(tiled(x)[0, repeats], tiled(x)[0, [3] * len(repeats)])
    if bias:  # NaN outputs (through the bias) at 600 and later at 900: every row's argmax is the first NaN
        tiled.bias[600], tiled.bias[900] = float("nan"), float("nan")
        nan_ids = tiled.argmax(x)[0]  # type: ignore[index]
        assert torch.equal(nan_ids, argmax_ids(tiled(x))) and set(nan_ids.tolist()) == {600}


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 17, 33])
@pytest.mark.parametrize("out_features", [1000, 4096, 37, 151_936])
def test_the_tiled_argmax_gives_each_chosen_ids_log_softmax_from_the_same_pass(kernel_name: str, rows: int,
                                                                                out_features: int) -> None:
    """With logprobs asked, each row's log-softmax at its argmax — a greedy token's logprob, what the cascade reads
    — folded into the pass that finds the argmax (nothing written): log_softmax's value on the outputs within
    float32 summation error, for peaked and near-flat rows and a vocabulary's width; the ids do not change."""
    from engines.sampler import argmax_ids

    kernel = tiled_kernel(kernel_name)
    torch.manual_seed(out_features * 7 + rows)
    tiled = TiledW8A8Linear.from_linear(nn.Linear(256, out_features), torch.float32, kernel)
    x = torch.randn(rows, 256) * torch.logspace(-2, 1.5, rows).unsqueeze(1)  # near-flat to sharply peaked rows
    chosen = tiled.argmax(x, with_logprobs=True)
    assert chosen is not None and chosen[1] is not None
    ids, logprobs = chosen
    outputs = tiled(x)
    assert torch.equal(ids, argmax_ids(outputs))
    expected = torch.log_softmax(outputs.double(), dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, atol=2e-5, rtol=1e-5)
    no_rows = tiled.argmax(x[:0], with_logprobs=True)
    assert no_rows is not None and no_rows[0].shape == (0,) and no_rows[1] is not None and no_rows[1].shape == (0,)


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
def test_a_row_gives_the_same_bits_alone_or_in_a_batch_on_the_tiled_kernels(kernel_name: str) -> None:
    tiled, _ = tiled_pair(kernel_name, 896, 192, True)
    x = torch.randn(21, 896)
    together = tiled(x)
    assert all(torch.equal(tiled(x[row : row + 1]), together[row : row + 1]) for row in range(21))


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
def test_the_tiled_weight_is_the_only_copy_and_serves_rows_a_cut_head_and_a_tied_embedding(kernel_name: str) -> None:
    tiled, reference = tiled_pair(kernel_name, 200, 150, True)
    assert tiled.weight.numel() == 192 * 256  # padded to whole tiles; no [N, K] weight beside it
    ids = torch.tensor([0, 149, 64, 17, 17])
    assert torch.equal(tiled.weight_rows(ids), reference.weight[ids])
    cut = first_output_rows(tiled, 70)
    assert isinstance(cut, TiledW8A8Linear) and cut.weight.data_ptr() == tiled.weight.data_ptr()
    x = torch.randn(3, 200)
    assert torch.equal(cut(x), reference(x)[:, :70])
    embedding = nn.Embedding(150, 200)
    shared = Int8Embedding.from_embedding(embedding, torch.float32, tied_head=tiled)
    assert shared.weight.data_ptr() == tiled.weight.data_ptr()
    assert torch.equal(shared(ids), Int8Embedding(reference.weight, reference.scales, torch.float32)(ids))


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 17, 40])  # AMX: a block of 16 and the rest; VNNI: of 4
@pytest.mark.parametrize("bias", [False, True])
def test_a_gate_up_product_applies_silu_and_the_product_itself(kernel_name: str, rows: int, bias: bool) -> None:
    intermediate = 192  # three groups of 64 per half: gate group g meets up group g + 3
    tiled, reference = tiled_pair(kernel_name, 200, 2 * intermediate, bias)
    assert tiled.gates
    x = torch.randn(rows, 200) * torch.logspace(-2, 2, rows).unsqueeze(1)
    gate, up = reference(x).split(intermediate, dim=-1)
    out = torch.full((rows, intermediate), float("nan"))
    out.copy_(tiled.silu_and_mul(x))  # an unwritten element would stay NaN
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)  # SiLU's exponential: a few ulp


@pytest.mark.parametrize("kernel_name", TILED_KERNELS)
def test_an_mlp_on_a_tiled_gate_up_takes_the_combined_product_and_gives_the_same_result(kernel_name: str) -> None:
    config = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=200, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=50)
    mlp = MLP(config)
    fused = MLP(config)
    fused.load_state_dict(mlp.state_dict())
    kernel = {"amx": w8a8_amx, "vnni": w8a8_vnni}[kernel_name]()
    fused.gate_up_proj = TiledW8A8Linear.from_linear(mlp.gate_up_proj, torch.float32, kernel)
    mlp.gate_up_proj = W8A8Linear.from_linear(mlp.gate_up_proj, torch.float32)
    x = torch.randn(7, 200)
    calls = []
    fused.gate_up_proj.forward = lambda *args: calls.append(args)  # the unfused path would call it (and fail)
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)
    assert not calls
    assert not TiledW8A8Linear.from_linear(nn.Linear(200, 2 * 96), torch.float32, kernel).gates  # 96: not whole groups


def int16_rows_product(layer: Int8Linear, x: torch.Tensor, x_levels: int) -> torch.Tensor:
    """The int8 kernel's arithmetic said in PyTorch: each row rounded half to even to int16 levels of its
    own scale, exact integer dot products with the int8 weight, then two float32 multiplies and the bias."""
    row_scales = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / x_levels
    dots = torch.round(x / row_scales).long() @ layer.weight.long().t()  # exact in int64
    out = dots.float() * row_scales * layer.gemv_scales
    return out + layer.gemv_bias if layer.gemv_bias is not None else out


@needs_library
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 21])
# 8,968 features: rows whose int16 copies outgrow L1d, where the features go in slices (and an 8-wide tail)
@pytest.mark.parametrize(("in_features", "bias"), [(256, False), (200, True), (4864 // 8, True), (8968, True)])
def test_the_int8_kernel_is_the_quantised_layer_on_int16_activations(rows: int, in_features: int, bias: bool) -> None:
    with_kernel, packed = layer_pair(Int8Linear, in_features, 37, bias)  # 37 outputs: the threads' shares end mid-way
    kernel = with_kernel.gemv
    assert kernel is not None
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, rows).unsqueeze(1)
    x[0, :2] = torch.tensor([x[0].abs().max() * 1.5, 0.0])  # scale set by the first value ...
    x[0, 2:4] = x[0, 0] / kernel.x_levels * torch.tensor([2.5, -3.5])  # ... so these two lie halfway
    out = with_kernel(x)
    assert torch.equal(out, int16_rows_product(with_kernel, x, kernel.x_levels))
    exact = x.double() @ with_kernel.dequantize(torch.float64).t()
    if bias:
        exact += with_kernel.bias.double()
    # int16 rounding of the activations: a relative error of ~1e-4 of a row's largest value per element.
    torch.testing.assert_close(out.double(), exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
    # The packed kernel rounds activations and results to bfloat16: the same layer within that.
    torch.testing.assert_close(packed(x), out, rtol=2e-2, atol=2e-2 * exact.abs().max().item())


@needs_library
@pytest.mark.parametrize("rows", [3, 21])
def test_the_int8_kernel_carries_its_sums_across_feature_slices_for_every_block_of_weight_rows(rows: int) -> None:
    """Rows outgrowing L1d go through the features in slices, 64 weight rows at a time: 150 outputs give each of two
    threads more than one such block, 8,968 features several slices and a tail."""
    with_kernel, _ = layer_pair(Int8Linear, 8968, 150, True)
    x = torch.randn(rows, 8968) * torch.logspace(-2, 2, rows).unsqueeze(1)
    out = with_kernel(x)
    assert torch.equal(out, int16_rows_product(with_kernel, x, with_kernel.gemv.x_levels))  # type: ignore[union-attr]
    assert torch.equal(out, torch.cat([with_kernel(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.parametrize("in_features", [200, 256])
def test_the_int8_layer_without_its_kernel_is_right_at_any_width(in_features: int) -> None:
    """torch's packed int8 op misreads rows whose width is not a multiple of 16 on AVX-512 CPUs (wrong sums
    in about half of the calls, sometimes a crash): the layer must not hand it such a width."""
    _, packed = layer_pair(Int8Linear, in_features, 37, True)
    weight = packed.dequantize(torch.float64)
    for rows in [1, 3, 21] * 10:
        x = torch.randn(rows, in_features)
        exact = x.to(torch.bfloat16).double() @ weight.t() + packed.bias.double()
        torch.testing.assert_close(packed(x).double(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())


@needs_library
@pytest.mark.parametrize("rows", [1, 2])  # two rows of this width take the features in slices
def test_the_int8_kernel_sums_exactly_at_its_largest_inputs(rows: int) -> None:
    """Every weight ±127 and every activation at its row's extreme: the int32 lanes must not wrap."""
    kernel = int8_gemv()
    assert kernel is not None
    in_features = kernel.max_k
    layer = Int8Linear(
        torch.full((2, in_features), 127, dtype=torch.int8).index_fill_(0, torch.tensor([1]), -127),
        torch.ones(2),
        None,
        torch.float32,
    )
    x = torch.full((rows, in_features), 3.0)
    expected = torch.tensor([[127.0 * 3 * in_features, -127.0 * 3 * in_features]] * rows)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x), int16_rows_product(layer, x, kernel.x_levels))
    too_wide = Int8Linear.from_linear(nn.Linear(kernel.max_k + 8, 4), torch.float32)
    assert too_wide.gemv is None  # beyond the exactness bound: the packed kernel takes every call


@needs_library
@pytest.mark.parametrize("in_features", [200, 8968])  # whole weight rows, and the features in slices
def test_a_row_through_the_int8_kernel_is_the_same_bits_in_any_batch(in_features: int) -> None:
    """A speculative verification step (k + 1 rows a sequence) must give the logits plain decoding does."""
    with_kernel, _ = layer_pair(Int8Linear, in_features, 37, True)
    x = torch.randn(21, in_features)
    alone = torch.cat([with_kernel(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(with_kernel(x), alone)
    assert torch.equal(with_kernel(x[4:9]), alone[4:9])


@needs_library
def test_a_row_through_the_int8_kernel_is_the_same_bits_in_a_prefill_chunk() -> None:
    """Prefill chunks on AVX2 take the kernel too (`RowDispatchLinear`): a token's product must not depend on
    whether it was prefilled or decoded, across the kernel's passes over the weight (64 rows at 1536 features)."""
    with_kernel, _ = layer_pair(Int8Linear, 1536, 37, True)
    kernel = with_kernel.gemv
    assert kernel is not None
    x = torch.randn(203, 1536) * torch.logspace(-2, 2, 203).unsqueeze(1)
    chunk = kernel(x, with_kernel.weight, with_kernel.gemv_scales, with_kernel.gemv_bias)
    assert torch.equal(chunk, torch.cat([with_kernel(x[i : i + 1]) for i in range(len(x))]))
    assert torch.equal(chunk, int16_rows_product(with_kernel, x, kernel.x_levels))


@needs_library
def test_the_int8_kernel_takes_rows_of_a_multiple_of_eight_features() -> None:
    kernel = int8_gemv()
    assert kernel is not None
    with_kernel, packed = layer_pair(Int8Linear, 64, 16, False)
    many = torch.randn(PACKED_MAX_ROWS + 1, 64)
    assert torch.equal(with_kernel(many), packed(many))  # the layer alone: beyond PACKED_MAX_ROWS, the packed path
    with pytest.raises(ValueError, match="multiple of 8"):
        kernel(torch.randn(2, 60), torch.zeros(16, 60, dtype=torch.int8), with_kernel.gemv_scales, None)
    with pytest.raises(ValueError, match="one row or more"):
        kernel(torch.randn(0, 64), with_kernel.weight, with_kernel.gemv_scales, None)
    odd = Int8Linear.from_linear(nn.Linear(60, 16), torch.float32)
    assert odd.gemv is None  # 60 features: not a multiple of 8, the packed kernel takes every call
    assert RowDispatchLinear(with_kernel).packed.gemv is kernel


def test_a_cpu_without_avx2_keeps_the_pytorch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert cpu_kernels._library.__wrapped__() is None


@needs_library
def test_a_cpu_without_vnni_gets_the_avx2_kernels_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_kernels.w8a8_vnni.__wrapped__() is None
    assert cpu_kernels.w8a8_amx.__wrapped__() is None
    assert cpu_kernels.int8_gemv.__wrapped__() is not None
    attention = cpu_kernels.paged_decode_attention.__wrapped__()
    assert attention is not None and attention.lanes == 8


def test_a_kernel_that_does_not_compile_is_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setattr(cpu_kernels, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: cpu_kernels.REQUIRED_CPU_FLAGS)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels._library.__wrapped__() is None
    assert "did not compile" in caplog.text or "no C compiler" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left to load later


BLOCK_SIZE = 4


def decode_metadata(
    block_tables: torch.Tensor, context_lens: torch.Tensor, kernel: PagedDecodeAttention | None
) -> AttentionMetadata:
    """Metadata of a step of decode rows only, as the model runner builds it with or without the kernel."""
    slots = torch.stack([block_tables[t, (n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                         for t, n in enumerate(context_lens.tolist())])  # fmt: skip
    positions = torch.arange(block_tables.shape[1] * BLOCK_SIZE)
    return AttentionMetadata(
        block_size=BLOCK_SIZE, slot_mapping=slots, num_decode_tokens=len(context_lens),
        decode_block_tables=block_tables,
        decode_mask=None if kernel else (positions.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :],
        prefills=[], decode_context_lens=context_lens if kernel else None, decode_kernel=kernel,
    )  # fmt: skip


def attention_kernel(isa: str) -> PagedDecodeAttention:
    library = cpu_kernels._library()
    assert library is not None
    return PagedDecodeAttention(library, isa)


@needs_library
@pytest.mark.parametrize("isa", ATTENTION_ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (14, 2, 64), (12, 2, 128)])
def test_decode_attention_reads_the_paged_cache_as_the_pytorch_path_does(
    isa: str, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(head_dim)
    num_blocks = 12
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim).to(kv_dtype)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim).to(kv_dtype)
    # Three rows: blocks out of order and shared, context lengths that end mid-block, one a single token.
    block_tables = torch.tensor([[7, 2, 9, 4], [3, 0, 0, 0], [5, 11, 2, 0]])
    context_lens = torch.tensor([15, 1, 10])
    query = torch.randn(3, num_heads, head_dim)
    key, value = torch.randn(3, num_kv_heads, head_dim), torch.randn(3, num_kv_heads, head_dim)
    outputs = []
    for kernel in (None, attention_kernel(isa)):
        caches = k_cache.clone(), v_cache.clone()
        metadata = decode_metadata(block_tables, context_lens, kernel)
        outputs.append(paged_attention(query, key, value, *caches, metadata, head_dim**-0.5))
    # The PyTorch path rounds queries and outputs to the cache dtype; the kernel keeps float32.
    tolerance = 1e-5 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)


@needs_library
@pytest.mark.parametrize("isa", ATTENTION_ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_reading_the_cache_ahead_changes_no_bit(isa: str, kv_dtype: torch.dtype) -> None:
    """Decode rows ask for positions two dozen ahead of the one they read (prefill chunks do not): over contexts
    long enough to do so through scattered blocks, the same bits either way."""
    torch.manual_seed(2)
    k_cache, v_cache = (torch.randn(40 * BLOCK_SIZE, 2, 64).to(kv_dtype) for _ in range(2))
    block_tables = torch.randperm(40)[:36].view(3, 12)
    context_lens = torch.tensor([12 * BLOCK_SIZE, 7 * BLOCK_SIZE + 5, 30])
    query = torch.randn(3, 14, 64)
    kernel = attention_kernel(isa)
    ahead, not_ahead = (kernel(query, k_cache, v_cache, block_tables, context_lens, BLOCK_SIZE, 0.125,
                               fetch_ahead=fetch) for fetch in (True, False))  # fmt: skip
    assert torch.equal(ahead, not_ahead)


@pytest.mark.skipif("avx512bf16" not in ATTENTION_ISAS, reason="the bfloat16 dot-product build needs AVX512_BF16")
def test_bf16_dot_products_change_nothing_on_a_float32_cache_or_a_head_they_do_not_fill() -> None:
    """`vdpbf16ps` reads bfloat16 caches with heads of a multiple of 32 dims; anything else takes the AVX-512 code."""
    torch.manual_seed(1)
    block_tables, context_lens = torch.tensor([[3, 1, 4, 0], [2, 5, 0, 0]]), torch.tensor([13, 6])
    for kv_dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 16)):
        k_cache, v_cache = (torch.randn(6 * BLOCK_SIZE, 2, head_dim).to(kv_dtype) for _ in range(2))
        query = torch.randn(2, 6, head_dim)
        outputs = [attention_kernel(isa)(query, k_cache, v_cache, block_tables, context_lens, BLOCK_SIZE, 0.125)
                   for isa in ("avx512", "avx512bf16")]
        assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif("avx512bf16" not in ATTENTION_ISAS, reason="prefill through the kernel needs AVX512_BF16")
def test_prefill_chunks_attend_through_the_kernel_as_sdpa_would_over_a_bfloat16_cache() -> None:
    """A prompt prefilled in two chunks (the second over the cached first), every row's logits: through the kernel
    (on AMX tiles 16 query rows a tile, else each query token a decode row over its causal context), against SDPA's
    causal and masked attention."""
    config = ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=128, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         attention_bias=True)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config, max_positions=64)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    prompt = torch.randint(0, 96, (45,)).tolist()
    table = [2, 0, 3]  # blocks of 16 (the AMX kernel's least), out of order
    logits = []
    for through_kernel in (True, False):
        runner = ModelRunner(model, config, 16, num_kv_blocks=4, kv_cache_dtype=torch.bfloat16)
        assert runner.prefill_attention is not None
        if not through_kernel:
            runner.prefill_attention = None
        chunks = [TokenSpan(prompt[:10], 0, table, "all"), TokenSpan(prompt[10:], 10, table, "all")]
        logits.append(torch.cat([runner.forward([chunk]) for chunk in chunks]))
    scale = logits[1].abs().max().item()
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=2e-2 * scale)  # bfloat16 q, weights: as SDPA's


@pytest.mark.skipif("amx" not in ATTENTION_ISAS, reason="attention on AMX tiles needs AMX-BF16 (e.g. Intel Sapphire "
                    "Rapids) and the OS's grant of tile state")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(14, 2, 64), (12, 2, 128), (16, 1, 96)])
def test_attention_on_amx_tiles_reads_blocks_of_16_as_the_bf16_build_does(num_heads: int, num_kv_heads: int,
                                                                           head_dim: int) -> None:  # fmt: skip
    """Blocks of 16 positions (q · k a tile of 16 positions at a time), contexts ending anywhere in a tile of 16 or a
    step of 32 positions (Σ weight · v), a whole group of 16 heads, and heads of 64, 128 and 96 dims (64 at a time,
    then 32); slots past each context hold NaN, which must not reach the output. Against the `vdpbf16ps` build,
    which rounds q and the weights to bfloat16 alike and sums in another order."""
    torch.manual_seed(head_dim)
    block_size, num_blocks, blocks_each = 16, 120, 13
    k_cache, v_cache = (torch.randn(num_blocks * block_size, num_kv_heads, head_dim).bfloat16() for _ in range(2))
    context_lens = torch.tensor([1, 15, 16, 17, 31, 32, 33, 200])
    block_tables = torch.randperm(num_blocks)[:8 * blocks_each].view(8, blocks_each).sort(dim=1).values  # their own
    for t, length in enumerate(context_lens.tolist()):
        for p in range(length, blocks_each * block_size):  # the rest of each row's blocks
            slot = block_tables[t, p // block_size] * block_size + p % block_size
            k_cache[slot], v_cache[slot] = float("nan"), float("nan")
    query = torch.randn(8, num_heads, head_dim)
    amx, bf16 = (attention_kernel(isa)(query, k_cache, v_cache, block_tables, context_lens, block_size,
                                       head_dim**-0.5) for isa in ("amx", "avx512bf16"))  # fmt: skip
    assert not amx.isnan().any()
    torch.testing.assert_close(amx, bf16, atol=1e-3, rtol=1e-3)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_computed: int,
                     scale: float) -> torch.Tensor:
    """float64 reference: query [n, H, D] at positions [num_computed, num_computed + n), keys/values [L, KVH, D]; q
    rounded to bfloat16 as the kernels round it."""
    group = query.shape[1] // keys.shape[1]
    q = query.bfloat16().double().transpose(0, 1)
    k, v = (x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (keys, values))
    visible = torch.arange(keys.shape[0]) <= num_computed + torch.arange(query.shape[0]).unsqueeze(1)
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).float()


@pytest.mark.skipif("amx" not in ATTENTION_ISAS, reason="attention on AMX tiles needs AMX-BF16 (e.g. Intel Sapphire "
                    "Rapids) and the OS's grant of tile state")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(14, 2, 64), (12, 2, 128), (16, 1, 96)])
@pytest.mark.parametrize(("num_computed", "rows"), [(0, 1), (0, 17), (5, 40), (31, 33), (100, 300)])
def test_a_prefill_chunk_on_amx_tiles_attends_causally_over_its_blocks(num_heads: int, num_kv_heads: int,
                                                                        head_dim: int, num_computed: int,
                                                                        rows: int) -> None:  # fmt: skip
    """Tiles of 16 query rows that end anywhere, contexts ending anywhere in a block of 16 or a step of 32 positions,
    blocks out of order with NaN in the slots past the chunk's end (which must not reach the output); within
    bfloat16 rounding of the query and the weights of float64 attention. Each row depends on its query and context
    only: the chunk's second half alone, over the first half as cached, gives the same bits."""
    torch.manual_seed(head_dim + rows)
    block_size, num_blocks = 16, 40
    length = num_computed + rows
    table = torch.randperm(num_blocks)[:-(-length // block_size)]
    k_cache, v_cache = (torch.randn(num_blocks * block_size, num_kv_heads, head_dim).bfloat16() for _ in range(2))
    slots = table[torch.arange(len(table) * block_size) // block_size] * block_size + torch.arange(
        len(table) * block_size) % block_size
    k_cache[slots[length:]], v_cache[slots[length:]] = float("nan"), float("nan")
    query = torch.randn(rows, num_heads, head_dim)
    kernel = cpu_kernels.prefill_attention(num_heads, num_kv_heads, head_dim, torch.bfloat16, block_size)
    assert isinstance(kernel, cpu_kernels.PagedPrefillAttention)
    out = kernel.attend_chunk(query, k_cache, v_cache, table, num_computed, block_size, head_dim**-0.5)
    expected = causal_attention(query, k_cache[slots[:length]], v_cache[slots[:length]], num_computed,
                                head_dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    half = rows // 2
    later = kernel.attend_chunk(query[half:], k_cache, v_cache, table, num_computed + half, block_size,
                                head_dim**-0.5)
    assert torch.equal(later, out[half:])


@needs_library
@pytest.mark.parametrize("isa", ATTENTION_ISAS)
def test_the_decode_kernel_attends_a_prefill_chunk_as_decode_rows(isa: str) -> None:
    """`attend_chunk` of the decode kernel (how chunks attend where the CPU reads bfloat16 with `vdpbf16ps` but has
    no AMX): each query row a decode row over its causal context, as float64 attention computes it."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_computed, rows = 14, 2, 64, 16, 31, 33
    table = torch.tensor([3, 0, 5, 1])
    k_cache, v_cache = (torch.randn(6 * block_size, num_kv_heads, head_dim).bfloat16() for _ in range(2))
    positions = torch.arange(num_computed + rows)
    slots = table[positions // block_size] * block_size + positions % block_size
    query = torch.randn(rows, num_heads, head_dim)
    out = attention_kernel(isa).attend_chunk(query, k_cache, v_cache, table, num_computed, block_size,
                                             head_dim**-0.5)
    expected = causal_attention(query, k_cache[slots], v_cache[slots], num_computed, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


@needs_library
def test_rope_over_rows_in_c_is_the_same_bits_as_the_pytorch_ops() -> None:
    """RoPE on the q and k heads of a q/k/v product's rows (a strided view), as the attention module applies it."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, rows = 14, 2, 64, 37
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim) * 3
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].reshape(rows, num_heads + num_kv_heads, head_dim)
    cos, sin = rope_cos_sin(head_dim, 4096, 1e6)
    positions = torch.randint(0, 4096, (rows,))
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    kernel = cpu_kernels.rope_rows()
    with torch.no_grad():
        assert kernel is not None and kernel.supports(qk, cos, sin)
        assert torch.equal(kernel(qk, cos, sin), qk * cos + qk.roll(head_dim // 2, dims=-1) * sin)


@needs_library
def test_rms_norm_over_rows_in_c_normalises_as_the_reference_does() -> None:
    """The decode layer's RMSNorm over a step's rows (its own sum order: a few ulp from torch's mean)."""
    torch.manual_seed(0)
    norm = RMSNorm(896, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(21, 896) * 5
        expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        kernel = cpu_kernels.rms_norm_rows()
        assert kernel is not None and kernel.supports(x, norm.weight)
        torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
        assert not kernel.supports(x.bfloat16(), norm.weight) and not kernel.supports(x[:, :20], norm.weight[:20])


@needs_library
@pytest.mark.parametrize("isa", ATTENTION_ISAS)
def test_decode_attention_sees_only_its_context(isa: str) -> None:
    """Slots past a row's context length in its last block hold another sequence's K/V: they must not count."""
    kernel = attention_kernel(isa)
    head_dim = 16
    k_cache, v_cache = torch.zeros(2 * BLOCK_SIZE, 1, head_dim), torch.zeros(2 * BLOCK_SIZE, 1, head_dim)
    v_cache[:3] = 1.0  # the row's three positions
    v_cache[3:] = 1000.0  # the rest of its block, and the next block: someone else's
    k_cache[3:] = 50.0  # keys that would win every score if they were read
    out = kernel(torch.ones(1, 1, head_dim), k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([3]),
                 BLOCK_SIZE, 1.0)  # fmt: skip
    assert torch.equal(out, torch.ones(1, 1, head_dim))


@needs_library
@pytest.mark.parametrize("isa", ATTENTION_ISAS)
def test_decode_attention_takes_blocks_of_a_power_of_two_tokens_only(isa: str) -> None:
    kernel = attention_kernel(isa)
    assert kernel.supports(14, 2, 64, torch.float32, block_size=16)
    assert not kernel.supports(14, 2, 64, torch.float32, block_size=12)  # the engine then uses PyTorch ops
    cache = torch.zeros(12, 1, 16)
    with pytest.raises(ValueError, match="blocks of 12"):
        kernel(torch.ones(1, 1, 16), cache, cache, torch.tensor([[0]]), torch.tensor([3]), 12, 1.0)
