"""RMSNorm, optionally fused with the residual add before it, in Triton (the CUDA path), and its PyTorch reference.

A decode step on a GPU is bound by how many small kernels it launches, not by bytes (BENCHMARKS.md, the engine
on a GPU): PyTorch runs `residual + x` and an RMSNorm in float32 as nine kernels (add, cast, square, mean, add
eps, rsqrt, scale, cast back, weight), twice a layer. This is one kernel, one program per row:

    residual' = residual + x            (rounded to x's dtype, as the unfused add is)
    out       = weight * (r32 * rsqrt(mean(r32²) + eps)).to(dtype)    with r32 = residual' in float32

which is `engines.models.llama.RMSNorm` step for step (the normalised row rounded to the activation dtype
before the weight multiplies it, as the reference implementation does).

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import to run the
kernel on CPU through Triton's interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read when HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    residual_out_ptr,  # written when HAS_RESIDUAL: residual + x
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two ≥ hidden
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] (rows contiguous), weight [hidden], residual [T, hidden] or None →
    (RMSNorm(residual + x) in x's dtype, residual + x); without a residual the second is x itself."""
    num_rows, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError("x and residual must be [T, hidden] with contiguous rows")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            summed,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            summed.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out, summed


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm`, in PyTorch ops (what `engines.models.llama` computes unfused)."""
    summed = x if residual is None else residual + x
    x32 = summed.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed
