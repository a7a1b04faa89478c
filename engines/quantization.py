"""Quantised nn.Linear layers for CPU inference (gpt-fast style).

int8 (weight-only): per-output-channel symmetric scales, `aten._weight_int8pack_mm`.
int4 (weight-only): group-wise asymmetric (scale + zero per group of 32/64/128 input columns), packed
for `aten._weight_int4pack_mm_for_cpu` (tinygemm layout: w ≈ (q - 8) * scale + zero).
w8a8: int8 weights as above and int8 activations with one scale per row, taken on the fly, the
product in int32: on CPUs with AMX or AVX-512 VNNI through `w8a8_amx` or `w8a8_vnni` over the weight in tile
order (`TiledW8A8Linear`), elsewhere through `torch._int_mm` (`W8A8Linear`: oneDNN), the same bits. The layers
`quantize_model(two_pass=...)` names take their input in two int8 passes (`W8A8Linear.activation_passes`): the
engine names the attention's projections (`EngineConfig.w8a8_attention_passes`).

The weight-only matmuls always run on bfloat16 activations (`COMPUTE_DTYPE`): with float32 ones the
int8 kernel is unvectorised, several times slower. `activation_dtype` is the model's activation
dtype: the layer returns it, and adds its bias in it.

Which is fastest depends on the CPU, and on the number of rows (decode steps have few, prefill
chunks many); `python -m bench.kernels` times all three here, and BENCHMARKS.md records the runs.
With int8 dot-product instructions (VNNI, AMX) w8a8 beats float32 at every row count while int8
weight-only loses on many-row prefill chunks; on AVX2-only CPUs int8 weight-only wins only for
few-row steps, and w8a8 is no faster than float32 beyond a few rows. Hence `auto`: w8a8 on CPUs
with int8 dot-product instructions, else int8 weight-only (`RowDispatchLinear`, built by
`quantize_model(dequantize_many_rows=True)`): decode steps and prefill chunks alike through our
`int8_gemv` (int16 activations, exact integer sums), or where that kernel cannot run, prefill chunks
through float32 sgemm over the int8 weights dequantised one layer at a time (a transient float copy of
one layer, never a resident float copy of the model).
w8a8 costs some quality (perplexity and top-1 agreement with float32, in BENCHMARKS.md);
`bench/engine.py` measures it in every run.

Unquantised float32 layers on a CPU run through oneDNN (`OneDnnLinear`, built by `pack_float_linears`): each weight
packed once into the layout oneDNN's GEMM reads, where `F.linear` (MKL's sgemm) packs it again at every call —
as much work as the product itself at a decode step's few rows (BENCHMARKS.md).

On CUDA the layers differ (`CUDA_QUANTIZATION_MODES`): int8 weight-only through the Triton kernel
`kernels.int8_matmul` (the int8 weight streamed and dequantised in registers: half the bytes of bfloat16),
and fp8 (e4m3) weights and per-row activations through `torch._scaled_mm` (Ada and Hopper tensor cores).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engines.cpu import has_int8_dot_product
from engines.cpu_kernels import (
    Int8Gemv,
    LayerProducts,
    Projection,
    TiledW8A8Kernel,
    int8_gemv,
    w8a8_tiled,
)

QUANTIZATION_MODES = ("int8", "int4", "w8a8")
CUDA_QUANTIZATION_MODES = ("int8", "fp8")
# CPU: w8a8 where the CPU has int8 dot products, else int8. CUDA: none — on the H200 bfloat16 weights beat int8
# and fp8 at batch 1, 16 and 64 for both demo tiers (a decode step there is bound by its kernel count, not by
# bytes: BENCHMARKS.md, the engine on a GPU); int8 and fp8 halve the weights' memory when that is what counts.
AUTO = "auto"
INT4_GROUP_SIZES = (32, 64, 128)
# 32, the width of the Q4_K sub-blocks the demo checkpoints come in: groups of 128 cost several times the
# perplexity for about an eighth fewer bytes (`python -m bench.quant_quality`, BENCHMARKS.md).
INT4_DEFAULT_GROUP_SIZE = 32
INT4_OUT_FEATURES_MULTIPLE = 16  # the CPU packing kernel's requirement
COMPUTE_DTYPE = torch.bfloat16
PACKED_MAX_ROWS = 48  # measured crossover: up to here the packed kernels beat float32 sgemm, above it they lose
_INT4_INNER_K_TILES = 2  # packing parameter of tinygemm's layout; the CPU kernel accepts 2, 4 or 8


def resolve_quantization(mode: str | None, device_type: str = "cpu") -> str | None:
    """The mode to run on `device_type` ("cpu" | "cuda"): `auto` becomes w8a8 or int8 for this CPU, and stays
    unquantised on CUDA; None (and "none") stay unquantised."""
    if mode is None or mode == "none":
        return None
    if device_type == "cuda":
        if mode == AUTO:
            return None
        if mode not in CUDA_QUANTIZATION_MODES:
            raise ValueError(f"quantization {mode!r} does not run on CUDA; expected none, {AUTO} or one of "
                             f"{CUDA_QUANTIZATION_MODES}")
        if mode == "fp8" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
            raise ValueError(f"fp8 needs a GPU of compute capability {FP8_MIN_CAPABILITY} or newer (Ada, Hopper)")
        return mode
    if mode == AUTO:
        return "w8a8" if has_int8_dot_product() else "int8"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; expected none, {AUTO} or one of {QUANTIZATION_MODES}")
    return mode


_QUANTIZE_ROWS = 4096  # rows quantised at a time: the float temporaries stay small beside a 150k-row head


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight_int8 [out, in], scales [out])` with weight ≈ weight_int8 * scales[:, None]."""
    return _quantize_rows(weight, torch.int8, 127, lambda levels: torch.round(levels).clamp(-128, 127), min_scale=1e-8)


def _quantize_rows(weight: torch.Tensor, dtype: torch.dtype, max_level: float,
                   to_levels: Callable[[torch.Tensor], torch.Tensor], min_scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`(weight_q [out, in] dtype, scales [out] float32)` with one scale per output row: |w| / scale ≤ max_level,
    cast to `dtype` through `to_levels`.

    Row block by row block: done whole, a tied head (151936 × 1536 at 1.5B) would make three float32
    temporaries of its size (2.8 GB) while loading."""
    quantized = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scales = torch.empty(weight.shape[0], device=weight.device)
    for start in range(0, weight.shape[0], _QUANTIZE_ROWS):
        rows = weight[start:start + _QUANTIZE_ROWS].float()
        block_scales = rows.abs().amax(dim=1).clamp(min=min_scale) / max_level
        quantized[start:start + _QUANTIZE_ROWS] = to_levels(rows / block_scales[:, None])
        scales[start:start + _QUANTIZE_ROWS] = block_scales
    return quantized, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(packed, scales_and_zeros [in / group_size, out, 2])` in the CPU int4pack layout."""
    out_features, in_features = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features ({in_features}) divisible by group_size ({group_size})")
    if out_features % INT4_OUT_FEATURES_MULTIPLE:
        raise ValueError(f"int4 needs out_features ({out_features}) divisible by {INT4_OUT_FEATURES_MULTIPLE}")
    groups = weight.float().reshape(-1, group_size)
    minimum, maximum = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scales = (maximum - minimum).clamp(min=1e-8) / 15
    values = torch.round((groups - minimum) / scales).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    zeros = minimum + 8 * scales  # the kernel computes (q - 8) * scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, _INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack(
        [scales.reshape(out_features, -1), zeros.reshape(out_features, -1)], dim=2
    ).transpose(0, 1)
    return packed, scales_and_zeros.contiguous()


# torch 2.13's `_weight_int8pack_mm` on AVX-512 CPUs reads past rows whose length is not a multiple of 16:
# wrong sums, sometimes a segfault (measured 2026-12-04, Intel Xeon: in_features 100 and 200 fail, every
# multiple of 16 tried from 16 to 4864 is exact). Such layers (rare: model widths are multiples of 64)
# take a dequantised matmul instead.
PACKED_K_MULTIPLE = 16


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scales)ᵀ + bias; matmul in bfloat16, result in `activation_dtype`.

    Decode-sized inputs (up to `PACKED_MAX_ROWS` rows) go through `int8_gemv` where this machine can run it:
    the same quantised weight (the stored bfloat16 scales), activations rounded per row to int16 levels
    (finer than the packed kernel's bfloat16) and exact integer sums, streamed faster than the packed kernel
    manages at few rows (BENCHMARKS.md), and each row's result the same bits in any batch (speculative
    verification rows match plain decoding). `gemv = None` forces the packed kernel."""

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, activation_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.activation_dtype = activation_dtype
        self.register_buffer("weight", weight_int8)
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.detach().to(activation_dtype))
        self.gemv = self._attach_gemv()

    def _attach_gemv(self) -> Int8Gemv | None:
        kernel = int8_gemv()
        if kernel is None or not kernel.supports(self.in_features):
            return None
        # The kernel's float32 operands: 4 bytes per output feature each.
        self.register_buffer("gemv_scales", self.scales.float(), persistent=False)
        self.register_buffer("gemv_bias", None if self.bias is None else self.bias.float(), persistent=False)
        return kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        weight_int8, scales = quantize_int8(linear.weight.detach())
        return cls(weight_int8, scales, linear.bias, activation_dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] as the packed kernel sees it (int8 values times the stored scales)."""
        return self.weight.to(dtype) * self.scales.to(dtype).unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.gemv is not None and 0 < rows.shape[0] <= PACKED_MAX_ROWS:
            return self.forward_gemv(x)
        rows = rows.to(COMPUTE_DTYPE)
        if self.in_features % PACKED_K_MULTIPLE:
            out = ((rows @ self.weight.to(COMPUTE_DTYPE).t()) * self.scales).to(self.activation_dtype)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales).to(self.activation_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The product through `int8_gemv`, any number of rows (at least one)."""
        out = self.gemv(x.reshape(-1, self.in_features).float(), self.weight, self.gemv_scales, self.gemv_bias)
        return out.to(self.activation_dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The row count oneDNN packs a weight for (`_reorder_linear_weight`'s batch-size hint). Measured on a Zen 4: one
# packing for 32 rows ran 1 to 512 rows as fast as packings for each, and every packing gives the same bits.
ONEDNN_PACK_ROWS = 32


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(nn.Module):
    """y = x @ weightᵀ + bias in the weight's float dtype, through oneDNN's linear (the operator PyTorch's own
    compiler uses for frozen CPU linears). `packed`: the weight is held in oneDNN's layout (an opaque tensor,
    in place of the dense one); else the dense weight is read as it is, e.g. a tied head's, which the
    embedding shares. A row's result is the same bits in any batch (tested)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        weight = weight.detach()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS) if packed
                             else weight)
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: nn.Linear, packed: bool = True) -> OneDnnLinear:
        return cls(linear.weight, linear.bias, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={self.packed}")


def pack_float_linears(model: nn.Module, shared: frozenset[str] = frozenset()) -> None:
    """Replace every float nn.Linear of `model` with a `OneDnnLinear`, in place: packed, except those named in
    `shared` (a tied head: packing it would hold a second copy beside the embedding table)."""
    for name, linear in _linear_modules(model, None):
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name,
                OneDnnLinear.from_linear(linear, packed=name not in shared))


def tensor_key(tensor: torch.Tensor) -> int:
    """What tells tensors apart when counting weight bytes, a shared tensor once: its data pointer, or for an
    opaque oneDNN tensor (no pointer; never shared) its identity."""
    return id(tensor) if tensor.is_mkldnn else tensor.data_ptr()


class Int4Linear(nn.Module):
    """Group-wise int4 weights; y = x @ dequant(W)ᵀ + bias; matmul in bfloat16, result in `activation_dtype`."""

    def __init__(
        self,
        packed_weight: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
        group_size: int,
        activation_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.activation_dtype = activation_dtype
        self.register_buffer("weight", packed_weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.detach().to(activation_dtype))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = INT4_DEFAULT_GROUP_SIZE,
        activation_dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        packed, scales_and_zeros = quantize_int4(linear.weight.detach(), group_size)
        return cls(
            packed, scales_and_zeros, linear.bias, linear.in_features, linear.out_features, group_size, activation_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        out = out.to(self.activation_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}"
        )


def activation_scales(rows: torch.Tensor) -> torch.Tensor:
    """`[rows, 1]`: each row's w8a8 scale, its largest magnitude over 127 (at least 1e-12 / 127)."""
    return rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127


def residual_rows(rows: torch.Tensor) -> torch.Tensor:
    """`[2 · rows, K]`: the float32 rows, then what rounding each to its int8 levels leaves, x − s · round(x / s):
    an input in two int8 passes (`W8A8Linear.activation_passes`)."""
    scales = activation_scales(rows)
    return torch.cat([rows, rows - torch.round(rows / scales) * scales])


def sum_passes(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product over `residual_rows` (without its bias) back to one row each: the two passes summed, then the bias."""
    rows = out.shape[0] // 2
    out = out[:rows] + out[rows:]
    return out if bias is None else out.add_(bias)


class W8A8Linear(Int8Linear):
    """Int8Linear's weights with int8 activations too (one scale per row, taken on the fly):
    y = (q(x) @ q(W)ᵀ) · s_row · s_col + bias, the product in int32 through `torch._int_mm` (oneDNN:
    VNNI where the CPU has it). Per-row scales keep every row independent of what else is in the
    batch, so a request's output does not depend on its batch mates.

    With `activation_passes = 2` the input goes in two int8 passes: the rows, then what their rounding left
    (`residual_rows`), as twice the rows of one product without the bias, each row's two results summed, then the
    bias (`sum_passes`). Where a few outlier features set a row's scale, one pass rounds the others coarsely; the
    second leaves at most 1/254 of that error, for twice the products. `quantize_model` gives two passes to the
    layers its `two_pass` names.

    `quantize_model` builds it only where neither tiled kernel runs (`TiledW8A8Linear`, the same bits faster);
    the tests and benchmarks use it as their reference."""

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, activation_dtype: torch.dtype,
        activation_passes: int = 1,
    ) -> None:
        super().__init__(weight_int8, scales, bias, activation_dtype)
        # The int32 product is rescaled (and the bias added) in float32.
        self.scales = scales.float()
        self.bias = None if bias is None else bias.detach().float()
        self.activation_passes = activation_passes

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation_dtype: torch.dtype = torch.bfloat16,
                    activation_passes: int = 1) -> W8A8Linear:
        weight_int8, scales = quantize_int8(linear.weight.detach())
        return cls(weight_int8, scales, linear.bias, activation_dtype, activation_passes)

    def _attach_gemv(self) -> Int8Gemv | None:
        return None  # `int8_gemv` rounds activations to int16: not this layer's arithmetic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.activation_passes == 2:
            out = sum_passes(self._product(residual_rows(rows), None), self.bias)
        else:
            out = self._product(rows, self.bias)
        return out.to(self.activation_dtype).reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        row_scales = activation_scales(rows)
        # |rows / row_scales| <= 127 by construction: rounding needs no clamp.
        quantized = torch.round(rows / row_scales).to(torch.int8)
        out = torch._int_mm(quantized, self.weight.t()).float().mul_(row_scales).mul_(self.scales)
        return out if bias is None else out.add_(bias)


class TiledW8A8Linear(nn.Module):
    """W8A8Linear on CPUs with AMX or AVX-512 VNNI: the same quantised weight, scales and activations and the same
    result bits, with the weight held in tile order (the only copy) and every row count on `w8a8_amx` or
    `w8a8_vnni`. A few rows cost little more than one there (one instruction covers 16 output features), which is
    what a speculative verification or a batched decode step needs; many rows (prefill) run faster than
    `torch._int_mm` too (`python -m bench.kernels`)."""

    def __init__(self, tiled_weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 weight_sum: torch.Tensor | None, in_features: int, out_features: int, activation_dtype: torch.dtype,
                 kernel: TiledW8A8Kernel, activation_passes: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation_dtype = activation_dtype
        self.kernel = kernel
        self.activation_passes = activation_passes  # as W8A8Linear's
        self.register_buffer("weight", tiled_weight)
        self.register_buffer("scales", scales.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # Σₖ w[n, k] for `w8a8_vnni`'s unsigned activations (4 bytes per output feature); None on AMX.
        self.register_buffer("weight_sum", weight_sum)

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation_dtype: torch.dtype, kernel: TiledW8A8Kernel,
                    activation_passes: int = 1) -> TiledW8A8Linear:
        weight_int8, scales = quantize_int8(linear.weight.detach())
        tiled, weight_sum = kernel.pack(weight_int8)
        return cls(tiled, scales, linear.bias, weight_sum, linear.in_features, linear.out_features, activation_dtype,
                   kernel, activation_passes)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 weight's rows `ids`, `[len(ids), in_features]`."""
        return self.kernel.rows(self.weight, ids, self.in_features)

    def first_output_rows(self, num_rows: int) -> TiledW8A8Linear:
        """The first `num_rows` output features, sharing the tiled weight (its leading blocks: a view)."""
        blocks = self.weight[:-(-num_rows // self.kernel.group)]
        bias = None if self.bias is None else self.bias[:num_rows]
        weight_sum = None if self.weight_sum is None else self.weight_sum[:num_rows]
        return TiledW8A8Linear(blocks, self.scales[:num_rows], bias, weight_sum, self.in_features, num_rows,
                               self.activation_dtype, self.kernel, self.activation_passes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        product = self.kernel.two_pass if self.activation_passes == 2 else self.kernel
        out = product(rows, self.weight, self.out_features, self.scales, self.bias, self.weight_sum)
        return out.to(self.activation_dtype).reshape(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor, with_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`self(x).argmax(-1)`'s ids for x [rows, in_features], and with `with_logprobs` the outputs' log-softmax
        at them (else None), the outputs compared in cache and never written (an LM head's greedy choice and its
        logprob: [rows, vocab] float32 logits are megabytes a step), where the kernel can (float32 activations, one
        pass: the very outputs `forward` returns); else None."""
        if self.activation_dtype != torch.float32 or self.activation_passes > 1:
            return None
        return self.kernel.argmax(x.reshape(-1, self.in_features).float(), self.weight, self.out_features, self.scales,
                                  self.bias, self.weight_sum, with_logprobs)

    @property
    def gates(self) -> bool:
        """Whether `silu_and_mul` runs: this is a gate_up projection [gate; up] the kernel can combine, in one pass."""
        return self.activation_passes == 1 and self.kernel.gates(self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate, up = self(x).split(out_features // 2, -1)`, in the product's own pass."""
        rows = x.reshape(-1, self.in_features).float()
        out = self.kernel.silu_mul(rows, self.weight, self.out_features, self.scales, self.bias, self.weight_sum)
        return out.to(self.activation_dtype).reshape(*x.shape[:-1], self.out_features // 2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation_passes={self.activation_passes}")


class _CudaQuantizedLinear(nn.Module):
    """What the CUDA layers share: quantised weight rows with one scale each (`quantize`), a bias kept in the
    activation dtype, results returned in it."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.activation_dtype = activation_dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.float())
        self.register_buffer("bias", None if bias is None else bias.detach().to(activation_dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation_dtype: torch.dtype = torch.bfloat16) -> _CudaQuantizedLinear:
        weight, scales = cls.quantize(linear.weight.detach())
        return cls(weight, scales, linear.bias, activation_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TritonInt8Linear(_CudaQuantizedLinear):
    """CUDA int8 weight-only: y = (x @ weight_int8ᵀ) * scales + bias in `kernels.int8_matmul`, which reads the
    int8 weight and dequantises it in registers (a dequantised copy would be written and read again: three
    times the bytes of the weight it replaces)."""

    quantize = staticmethod(quantize_int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.int8_matmul import int8_weight_only_matmul

        rows = x.reshape(-1, self.in_features).to(self.activation_dtype)
        out = int8_weight_only_matmul(rows, self.weight, self.scales, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)  # Ada; Hopper is (9, 0)
_FP8_ROWS_MULTIPLE = 16  # rows are padded to this for `_scaled_mm` (its row-wise scaling is only promised there)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight_fp8 [out, in] e4m3, scales [out] float32)` with weight ≈ weight_fp8 * scales[:, None]."""
    return _quantize_rows(weight, torch.float8_e4m3fn, FP8_MAX, lambda levels: levels, min_scale=1e-12)


class Fp8Linear(_CudaQuantizedLinear):
    """CUDA fp8: e4m3 weights with one scale per output channel, activations cast to e4m3 with one scale per
    row on the fly (rows stay independent of their batch mates), the product on fp8 tensor cores through
    `torch._scaled_mm` with row-wise scales, out in bfloat16."""

    quantize = staticmethod(quantize_fp8)

    def __init__(self, weight_fp8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype) -> None:
        super().__init__(weight_fp8, scales.reshape(1, -1), bias, activation_dtype)  # [1, out]: per column of y
        if self.out_features % 16 or self.in_features % 16:
            raise ValueError(f"fp8 needs in and out features divisible by 16, got {tuple(weight_fp8.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        padding = -num_rows % _FP8_ROWS_MULTIPLE
        if padding:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, padding))
        row_scales = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        quantized = (rows.float() / row_scales).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=row_scales, scale_b=self.scales,
                               out_dtype=torch.bfloat16)[:num_rows].to(self.activation_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class RowDispatchLinear(nn.Module):
    """An int8 weight-only layer for float32 activations on CPUs without native bfloat16: few rows (decode) on
    the packed kernel, many (prefill) through `int8_gemv` where this machine runs it, else on sgemm.

    `int8_gemv` gives a row the same bits in a prefill chunk as in a decode step, and cut the time to first
    token against sgemm over the dequantised weight (BENCHMARKS.md, 2026-12-05). Without it,
    the int8 weight is dequantised to the activation dtype for that one call: sgemm over a transient copy
    beats the packed kernel there, and no float copy of the weight stays resident. Every path computes with
    the same quantised weight; which one runs depends only on the number of rows.
    """

    def __init__(self, packed: Int8Linear, max_packed_rows: int = PACKED_MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.packed = packed
        self.max_packed_rows = max_packed_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.max_packed_rows:
            return self.packed(x)
        packed = self.packed
        if packed.gemv is not None:
            return packed.forward_gemv(x)
        return torch.nn.functional.linear(x, packed.dequantize(x.dtype), packed.bias)

    def extra_repr(self) -> str:
        return f"max_packed_rows={self.max_packed_rows}"


def native_operands(module: nn.Module) -> tuple[LayerProducts, Projection] | None:
    """How the whole-layer decode kernel multiplies by this layer, and its operands (`Projection`, float32 scales
    and bias), where it can: int8 weight-only on `int8_gemv`, w8a8 in tile order on AMX tiles or through VNNI,
    each with float32 activations; None for any other layer."""
    packed = module.packed if isinstance(module, RowDispatchLinear) else module
    if getattr(packed, "activation_dtype", None) != torch.float32:
        return None
    if type(packed) is TiledW8A8Linear:
        return packed.kernel.products, Projection(packed.weight, packed.scales, packed.bias, packed.weight_sum,
                                                  packed.activation_passes)
    if type(packed) is Int8Linear and packed.gemv is not None:
        return LayerProducts.INT8_WEIGHT_ONLY, Projection(packed.weight, packed.gemv_scales, packed.gemv_bias, None)
    return None


def first_output_rows(module: nn.Module, num_rows: int) -> nn.Module | None:
    """A projection onto the first `num_rows` outputs of `module`, sharing its weight (a view, no copy); None
    for a layout whose rows cannot be sliced (int4's packed tiles)."""
    if isinstance(module, RowDispatchLinear):
        packed = first_output_rows(module.packed, num_rows)
        return None if packed is None else RowDispatchLinear(packed, module.max_packed_rows)  # type: ignore[arg-type]
    if isinstance(module, TiledW8A8Linear):
        return module.first_output_rows(num_rows)
    if isinstance(module, Int8Linear | TritonInt8Linear):  # W8A8Linear too: each takes int8 rows, scales, bias
        bias = None if module.bias is None else module.bias[:num_rows]
        passes = (module.activation_passes,) if isinstance(module, W8A8Linear) else ()
        return type(module)(module.weight[:num_rows], module.scales[:num_rows], bias, module.activation_dtype, *passes)
    if isinstance(module, OneDnnLinear):
        return None if module.packed else OneDnnLinear(
            module.weight[:num_rows], None if module.bias is None else module.bias[:num_rows], packed=False)
    if type(module) is nn.Linear:
        head = nn.Linear(module.in_features, num_rows, bias=module.bias is not None, device="meta")
        head.weight = nn.Parameter(module.weight[:num_rows], requires_grad=False)
        if module.bias is not None:
            head.bias = nn.Parameter(module.bias[:num_rows], requires_grad=False)
        return head
    return None


class Int8Embedding(nn.Module):
    """Token embeddings as int8 rows with one scale each, looked up then dequantised.

    A tied head quantised to int8 holds exactly this (per-output-channel scales are per-row scales of
    the embedding), so the two share one int8 table instead of the embedding staying in float32.
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 tiled_head: TiledW8A8Linear | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight_int8)
        self.register_buffer("scales", scales)
        self.dtype = dtype
        # A tied head in AMX tile order shares its weight: rows are gathered from the tiles.
        self.tiled_head = None if tiled_head is None else (tiled_head.kernel, tiled_head.in_features)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, dtype: torch.dtype,
                       tied_head: nn.Module | None = None) -> Int8Embedding:
        """Share the int8 table of `tied_head` (the embedding, quantised as a head) when it is int8, else
        quantise the embedding."""
        packed = tied_head.packed if isinstance(tied_head, RowDispatchLinear) else tied_head
        if isinstance(packed, TiledW8A8Linear) and (packed.out_features, packed.in_features) == embedding.weight.shape:
            return cls(packed.weight, packed.scales, dtype, tiled_head=packed)
        if isinstance(packed, Int8Linear | TritonInt8Linear) and packed.weight.shape == embedding.weight.shape:
            return cls(packed.weight, packed.scales, dtype)
        weight_int8, scales = quantize_int8(embedding.weight.detach())
        return cls(weight_int8, scales, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tiled_head is None:
            rows = self.weight.index_select(0, input_ids).to(self.dtype)
        else:
            kernel, in_features = self.tiled_head
            rows = kernel.rows(self.weight, input_ids, in_features).to(self.dtype)
        return rows * self.scales.index_select(0, input_ids).to(self.dtype).unsqueeze(1)


def quantize_model(
    model: nn.Module,
    mode: str,
    activation_dtype: torch.dtype = torch.bfloat16,
    skip: Callable[[str], bool] | None = None,
    group_size: int = INT4_DEFAULT_GROUP_SIZE,
    dequantize_many_rows: bool = False,
    device_type: str = "cpu",
    two_pass: Callable[[str], bool] | None = None,
) -> None:
    """Replace every nn.Linear (by qualified name, unless `skip(name)`) with its quantised version, in place.
    w8a8 layers named by `two_pass` take their input in two int8 passes (`W8A8Linear.activation_passes`).

    `mode` is "int8", "int4" or "w8a8". An int4 layer whose in_features is not a multiple of `group_size`
    falls back to the largest supported group size dividing it; a layer the int4 kernel cannot take
    (no group size fits, or out_features not a multiple of 16) becomes int8. With `dequantize_many_rows`,
    each int8 weight-only layer becomes a `RowDispatchLinear` that runs many-row inputs through sgemm
    (worth it with float32 activations on CPUs without native bf16); w8a8 and int4 layers stay packed.
    `device_type="cuda"` builds the CUDA layers ("int8" or "fp8"; their weights still where the model's are).
    """
    if device_type == "cuda":
        if mode not in CUDA_QUANTIZATION_MODES:
            raise ValueError(f"unknown CUDA quantization mode {mode!r}; expected one of {CUDA_QUANTIZATION_MODES}")
        cuda_class = TritonInt8Linear if mode == "int8" else Fp8Linear
        for name, linear in _linear_modules(model, skip):
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, cuda_class.from_linear(linear, activation_dtype))
        return
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; expected one of {QUANTIZATION_MODES}")
    for name, linear in _linear_modules(model, skip):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        passes = 2 if two_pass is not None and two_pass(name) else 1
        packed = _quantized(linear, mode, activation_dtype, group_size, passes)
        dispatch = dequantize_many_rows and type(packed) is Int8Linear
        setattr(parent, child_name, RowDispatchLinear(packed) if dispatch else packed)


def _linear_modules(model: nn.Module, skip: Callable[[str], bool] | None) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not (skip is not None and skip(name))]


def _quantized(linear: nn.Linear, mode: str, activation_dtype: torch.dtype, group_size: int,
               activation_passes: int) -> nn.Module:
    if mode == "w8a8":
        kernel = w8a8_tiled()
        if kernel is not None:
            return TiledW8A8Linear.from_linear(linear, activation_dtype, kernel, activation_passes)
        return W8A8Linear.from_linear(linear, activation_dtype, activation_passes)
    if mode == "int4" and linear.out_features % INT4_OUT_FEATURES_MULTIPLE == 0:
        fitting = [size for size in INT4_GROUP_SIZES if size <= group_size and linear.in_features % size == 0]
        if fitting:
            return Int4Linear.from_linear(linear, max(fitting), activation_dtype)
    return Int8Linear.from_linear(linear, activation_dtype)
