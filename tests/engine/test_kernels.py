"""Paged-attention kernels: the PyTorch references against dense attention, and the Triton kernels
(run by Triton's CPU interpreter on tiny grids) against the references.

`@triton.jit` reads TRITON_INTERPRET at import time, so the Triton cases run in one subprocess with
that variable set; this test process never sees it, and never launches a Triton kernel itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]


def paged_copy(
    keys: list[torch.Tensor], values: list[torch.Tensor], num_blocks: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter per-sequence K/V [len, kv_heads, dim] into shuffled cache blocks; return caches and block tables."""
    from kernels.paged_attention import store_kvcache_reference

    generator = torch.Generator().manual_seed(seed)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(-(-len(k) // block_size) for k in keys)
    block_tables = torch.zeros(len(keys), max_blocks, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, *keys[0].shape[1:], dtype=keys[0].dtype)
    v_cache = torch.zeros_like(k_cache)
    for seq, (k, v) in enumerate(zip(keys, values, strict=True)):
        for logical in range(-(-len(k) // block_size)):
            block_tables[seq, logical] = free_blocks.pop()
        positions = torch.arange(len(k))
        slots = block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
        store_kvcache_reference(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, block_tables


def decode_case(
    context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in context_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in context_lens]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3  # a few blocks nobody uses
    k_cache, v_cache, block_tables = paged_copy(keys, values, num_blocks, block_size)
    return dict(
        query=torch.randn(len(context_lens), num_heads, head_dim, generator=generator).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        keys=keys,
        values=values,
    )


DECODE_CASES = {
    # name: (context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    "gqa_partial_blocks": ([9, 1, 16], 4, 2, 16, 4, torch.float32),
    "mha": ([5, 12], 2, 2, 32, 8, torch.float32),
    "head_dim_not_power_of_two": ([7], 2, 1, 24, 4, torch.float32),
    "bfloat16": ([11, 6], 4, 1, 16, 4, torch.bfloat16),
}


def test_reference_decode_equals_dense_attention() -> None:
    from kernels.paged_attention import paged_attention_decode_reference

    for name, (context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype) in DECODE_CASES.items():
        case = decode_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
        scale = head_dim**-0.5
        paged = paged_attention_decode_reference(
            case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"], scale
        )
        for seq, (k, v) in enumerate(zip(case["keys"], case["values"], strict=True)):
            dense = F.scaled_dot_product_attention(
                case["query"][seq].float().unsqueeze(1),  # [H, 1, D]
                k.float().transpose(0, 1),  # [KVH, L, D]
                v.float().transpose(0, 1),
                scale=scale,
                enable_gqa=True,
            ).squeeze(1)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(paged[seq].float(), dense, atol=tolerance, rtol=tolerance, msg=name)


def test_reference_store_writes_slots_and_skips_padding() -> None:
    from kernels.paged_attention import store_kvcache_reference

    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(9, dtype=torch.float32).reshape(3, 1, 3) + 1
    store_kvcache_reference(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(k_cache[0, 0], key[2])
    assert torch.equal(v_cache[2, 1], -key[0])
    assert int((k_cache != 0).any(dim=-1).sum()) == 2  # the padding row wrote nothing


# -- Triton kernels, interpreted ------------------------------------------------------------------------


def _interpreted_store_case(slot_dtype: torch.dtype) -> float:
    from kernels.paged_attention import store_kvcache, store_kvcache_reference

    generator = torch.Generator().manual_seed(2)
    key = torch.randn(5, 2, 8, generator=generator)
    value = torch.randn(5, 2, 8, generator=generator)
    slot_mapping = torch.tensor([13, 0, -1, 7, 30], dtype=slot_dtype)
    caches = [torch.full((8, 4, 2, 8), 0.5) for _ in range(4)]
    store_kvcache(key, value, caches[0], caches[1], slot_mapping)
    store_kvcache_reference(key, value, caches[2], caches[3], slot_mapping)
    return max((caches[0] - caches[2]).abs().max().item(), (caches[1] - caches[3]).abs().max().item())


def _interpreted_decode_case(name: str) -> float:
    from kernels.paged_attention import paged_attention_decode, paged_attention_decode_reference

    context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype = DECODE_CASES[name]
    case = decode_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    arguments = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"])
    triton_out = paged_attention_decode(*arguments, head_dim**-0.5)
    reference = paged_attention_decode_reference(*arguments, head_dim**-0.5)
    assert triton_out.dtype == dtype and triton_out.shape == case["query"].shape
    return (triton_out.float() - reference.float()).abs().max().item()


INTERPRETED_CASES: dict[str, Callable[[], float]] = {
    "store_int64_slots": lambda: _interpreted_store_case(torch.int64),
    "store_int32_slots": lambda: _interpreted_store_case(torch.int32),
    **{f"decode_{name}": (lambda name=name: _interpreted_decode_case(name)) for name in DECODE_CASES},
}


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    """Max abs error of each Triton case vs its reference, computed in a TRITON_INTERPRET=1 subprocess."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, __file__],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"Triton interpretation unavailable: {report['unavailable']}")
    return report


@pytest.mark.parametrize("case", [name for name in INTERPRETED_CASES if name.startswith("store")])
def test_triton_store_kvcache_matches_reference(interpreted_errors: dict[str, float], case: str) -> None:
    assert interpreted_errors[case] == 0.0


@pytest.mark.parametrize("case", [name for name in INTERPRETED_CASES if name.startswith("decode")])
def test_triton_decode_attention_matches_reference(interpreted_errors: dict[str, float], case: str) -> None:
    tolerance = 2e-2 if "bfloat16" in case else 1e-5
    assert interpreted_errors[case] < tolerance


def test_launchers_reject_bad_layouts() -> None:
    from kernels.paged_attention import paged_attention_decode

    query = torch.randn(1, 3, 16)
    k_cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode(query, k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1), 1.0)
    with pytest.raises(ValueError, match="caches must be"):
        paged_attention_decode(torch.randn(1, 2, 8), k_cache, k_cache, torch.zeros(1, 1), torch.ones(1), 1.0)
    with pytest.raises(ValueError, match="power of two"):
        odd = torch.zeros(2, 3, 2, 16)
        paged_attention_decode(torch.randn(1, 2, 16), odd, odd, torch.zeros(1, 1), torch.ones(1), 1.0)


if __name__ == "__main__":
    # The subprocess side of `interpreted_errors`: TRITON_INTERPRET=1 is already in the environment.
    try:
        import triton.language  # noqa: F401
    except Exception as error:  # no usable Triton install: let the tests skip
        print(json.dumps({"unavailable": f"{type(error).__name__}: {error}"}))
        sys.exit(0)
    print(json.dumps({name: case() for name, case in INTERPRETED_CASES.items()}))
