"""GGML block formats dequantised in torch give gguf-py's values, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engines.ggml import DEQUANTIZERS, dequantize_rows


def random_rows(ggml_type: int, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Rows of random blocks whose float16 fields hold finite scales (random bytes there could be NaN)."""
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, block_bytes), dtype=np.uint8)
    scale_offsets = {GGMLQuantizationType.Q6_K: (208,), GGMLQuantizationType.Q4_K: (0, 2),
                     GGMLQuantizationType.Q4_1: (0, 2)}.get(ggml_type, (0,))
    for offset in scale_offsets:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("ggml_type", sorted(DEQUANTIZERS), ids=lambda t: GGMLQuantizationType(t).name)
@pytest.mark.parametrize("rows", [1, 7])
def test_each_format_dequantises_to_gguf_values_bit_for_bit(ggml_type: int, rows: int) -> None:
    values_per_block, _ = GGML_QUANT_SIZES[ggml_type]
    data = random_rows(ggml_type, rows, blocks_per_row=3, seed=rows)
    expected = gguf_dequantize(data, ggml_type).reshape(rows, 3 * values_per_block)
    out = torch.full((rows, 3 * values_per_block), float("nan"))  # every element must be written
    dequantize_rows(data, ggml_type, out)
    assert np.array_equal(out.numpy(), expected)
