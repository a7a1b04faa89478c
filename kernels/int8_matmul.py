"""Int8 weight-only matrix products in Triton (the CUDA path of the engine's `int8` quantisation) and their
PyTorch reference.

`weight` is [N, K] int8 with per-output-channel float32 `scales` [N] (weight ≈ weight_int8 * scales[:, None]),
as `engines.quantization.quantize_int8` makes them; `x` is [M, K] bfloat16, float16 or float32:

    y [M, N] = (x @ weight_int8ᵀ) * scales + bias, in x's dtype.

The kernel converts each int8 weight tile to x's dtype (exact: |q| ≤ 128 fits every mantissa), multiplies on
tensor cores (float32 x: IEEE float32 on FMA units, not TF32) and accumulates in float32, so its products differ
from the float32 reference only by the sum order and the final rounding. Block sizes come from a fixed rule on
the shapes (no autotuning, no host synchronisation), so a launch can be captured in a CUDA graph.

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import
to run the kernel on CPU through Triton's interpreter (tests do this in a subprocess). Interpreted, the
products run in float32 (the interpreter cannot multiply bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Fewer programs than this leave SMs idle while the weight streams (an H100/H200 has 132 SMs): shrink BLOCK_N.
_MIN_PROGRAMS = 256

# -- Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _int8_weight_only_matmul_kernel(
    x_ptr,
    weight_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride_m,
    x_stride_k,
    out_stride_m,
    out_stride_n,
    HAS_BIAS: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,  # both operands in float32 (float32 x, or the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 offsets: N * K and M * N can pass 2^31 for large vocabularies or long prefills
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * x_stride_m + ks[None, :] * x_stride_k
    weight_ptrs = weight_ptr + cols[:, None] * K + ks[None, :]  # weight is contiguous [N, K]

    accumulator = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - k_block * BLOCK_K  # the K tail: zeros on both sides add nothing
        x_tile = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        weight_tile = tl.load(weight_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0)
        if DOT_FLOAT32:  # "ieee" keeps float32 operands off TF32 (10-bit mantissas)
            accumulator = tl.dot(x_tile.to(tl.float32), tl.trans(weight_tile.to(tl.float32)), accumulator,
                                 input_precision="ieee")
        else:  # the int8 → 16-bit conversion is exact: |q| ≤ 128 fits the mantissa
            accumulator = tl.dot(x_tile, tl.trans(weight_tile.to(x_ptr.dtype.element_ty)), accumulator)
        x_ptrs += BLOCK_K * x_stride_k
        weight_ptrs += BLOCK_K

    scales = tl.load(scales_ptr + cols, mask=col_mask, other=0.0)
    out = accumulator * scales[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride_m + cols[None, :] * out_stride_n,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# -- launchers -------------------------------------------------------------------------------------

# Triton's interpreter holds bfloat16 as uint16 bit patterns and its tl.dot multiplies those (unsupported
# upstream, triton-lang/triton#11584): interpreted, the dot runs in float32, which gives the same sums.
_INTERPRETED = not isinstance(_int8_weight_only_matmul_kernel, triton.runtime.JITFunction)


def int8_weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32), weight [N, K] int8 (row-major, contiguous), scales [N] float32
    (weight ≈ weight_int8 * scales[:, None]), bias [N] or None → [M, N] in x's dtype:
    y = (x @ weight_int8ᵀ) * scales + bias.

    `out` [M, N] (x's dtype, unit column stride) receives the result if given (a CUDA graph's static buffer).
    Block sizes and warps default to `choose_blocks`; on a GPU each block must be a power of two ≥ 16.
    """
    _check_operands(x, weight, scales, bias)
    M, N = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{M}, {N}] {x.dtype} on {x.device} with unit column stride, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    if M == 0 or N == 0:  # an empty grid is not a launch
        return out
    default_m, default_n, default_k, default_warps = choose_blocks(M, N, x.dtype)
    block_m, block_n, block_k = block_m or default_m, block_n or default_n, block_k or default_k
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int8_weight_only_matmul_kernel[grid](
        x,
        weight,
        scales,
        out if bias is None else bias,  # any pointer: HAS_BIAS=False never reads it
        out,
        M,
        N,
        x.shape[1],
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        DOT_FLOAT32=x.dtype == torch.float32 or _INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps or default_warps,
    )
    return out


def choose_blocks(M: int, N: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)` for an [M, K] × [K, N] product in `dtype`.

    Decode (M ≤ 64) reads each weight byte once per step and is bound by that: one M block covers every row
    (tl.dot needs ≥ 16), and long K blocks make wide loads. Prefill (M > 64) is bound by arithmetic: big square
    tiles. Float32 tiles are smaller: its "ieee" dot runs on FMA units, not tensor cores. Either way BLOCK_N
    halves (down to 16) while the grid has fewer than `_MIN_PROGRAMS` programs, so small N still fills the GPU.
    """
    if M <= 64:
        block_m, block_n, block_k, num_warps = max(16, triton.next_power_of_2(M)), 64, 128, 4
    else:
        block_m, block_n, block_k, num_warps = 128, 128, 64, 8
    if dtype == torch.float32:  # an FMA dot holds both operand tiles in registers
        block_m, block_n, block_k, num_warps = min(block_m, 64), 64, 32, 4
    while block_n > 16 and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < _MIN_PROGRAMS:
        block_n //= 2
    return block_m, block_n, block_k, num_warps


def _check_operands(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be [M, K] bfloat16, float16 or float32, got {tuple(x.shape)} {x.dtype}")
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[1]}] int8, got {tuple(weight.shape)} {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (row-major [N, K])")
    N = weight.shape[0]
    if scales.dtype != torch.float32 or scales.shape != (N,) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous [{N}] float32, got {tuple(scales.shape)} {scales.dtype}")
    if bias is not None and (bias.shape != (N,) or not bias.is_floating_point() or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous floating-point [{N}], got {tuple(bias.shape)} {bias.dtype}")
    others = [weight, scales] + ([] if bias is None else [bias])
    if any(tensor.device != x.device for tensor in others):
        raise ValueError(f"weight, scales and bias must be on x's device ({x.device})")


# -- PyTorch references ------------------------------------------------------------------------------


def int8_weight_only_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as `int8_weight_only_matmul`, in float32 math; the result in x's dtype."""
    out = (x.float() @ weight.float().t()) * scales.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
