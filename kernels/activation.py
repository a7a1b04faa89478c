"""SiLU(gate) · up in one Triton kernel (the CUDA path), and its PyTorch reference.

The MLP's gate and up projections are one matmul whose output holds [gate | up] per row; PyTorch then runs SiLU
and the product as two kernels over it. On a GPU, where a decode step is bound by its kernel count, this is one:
one program per (row, block of columns), each value rounded as the unfused ops round it (SiLU's result to the
activation dtype, then the product).

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import to run the
kernel on CPU through Triton's interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 · width] holding [gate | up] per row (rows contiguous) → SiLU(gate) · up [T, width] in x's dtype."""
    num_rows, double_width = x.shape
    if double_width % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2 * width] with contiguous rows, got {tuple(x.shape)}")
    width = double_width // 2
    out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(width, BLOCK))](x, out, x.stride(0), out.stride(0), width,
                                                                    BLOCK=BLOCK)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
