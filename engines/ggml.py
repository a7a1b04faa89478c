"""GGML block formats dequantised with torch: the formats of the demo checkpoints.

gguf-py's numpy dequantisation runs on one core through many temporaries, and it was most of an engine's
start (`python -m bench.memory` prints the seconds to load; BENCHMARKS.md). These are the same formulas,
operation for operation in float32, so the values are the same bits (tested against gguf-py); torch runs each op
on every core. Other formats go to gguf-py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

QK_K = 256  # values in a K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes `start:start + 2` of each block, as float32 `[n, 1]`."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """`[n, k * width]` bytes → `[n, 2k, width]` 4-bit values: each run of `width` bytes gives its low nibbles,
    then its high ones."""
    runs = packed.reshape(packed.shape[0], -1, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((runs >> shifts) & 0x0F).reshape(packed.shape[0], -1, width)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """34 bytes: scale (f16), 32 int8 values."""
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """20 bytes: scale and minimum (f16), 32 4-bit values."""
    values = _nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], 32).float()
    return _f16(blocks, 0) * values + _f16(blocks, 2)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """22 bytes: scale (f16), the 32 fifth bits (a little-endian uint32), 32 low nibbles."""
    high_bits = blocks[:, 2:6].contiguous().view(torch.int32)  # bit i is value i's fifth bit
    high = ((high_bits >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
    low = _nibbles(blocks[:, 6:], 16).reshape(blocks.shape[0], 32)
    values = (low | (high << 4)).view(torch.int8) - 16
    return _f16(blocks, 0) * values.float()


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """144 bytes: super-block scale and minimum (f16), 8 sub-block scales and minimums (6 bits each, packed in
    12 bytes), 256 4-bit values."""
    n = blocks.shape[0]
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1).float()
    minimums = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1).float()
    scale = (_f16(blocks, 0) * scales).reshape(n, 8, 1)
    minimum = (_f16(blocks, 2) * minimums).reshape(n, 8, 1)
    values = _nibbles(blocks[:, 16:], 32).float()
    return (scale * values - minimum).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """210 bytes: 256 low nibbles (128 bytes), their top two bits (64 bytes), 16 int8 sub-block scales, the
    super-block scale (f16)."""
    n = blocks.shape[0]
    scale = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    top = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    top = (top & 0x03).reshape(n, 8, 32)
    values = ((low | (top << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    return (scale * values).reshape(n, QK_K)


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: q8_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q4_K: q4_k, Q.Q6_K: q6_k,
}


def dequantize_rows(data: np.ndarray, ggml_type: int, out: torch.Tensor) -> None:
    """Rows of blocks `data` (`[rows, bytes]` uint8, e.g. a slice of the mapped file) into `out` (`[rows, values]`
    float32)."""
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = torch.from_numpy(np.array(data).reshape(-1, block_bytes))  # a copy: the file's map is read-only
    out.copy_(DEQUANTIZERS[ggml_type](blocks).reshape(out.shape))
