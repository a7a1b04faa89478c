"""Paged-attention kernels: the PyTorch references against dense attention, and the Triton kernels
(run by Triton's CPU interpreter on tiny grids) against the references.

`@triton.jit` reads TRITON_INTERPRET at import time, so the interpreted cases run in one subprocess with
that variable set; this test process never sees it, and launches Triton kernels itself only where CUDA is
available (the same cases natively, plus a CUDA-graph replay).

Decode cases use tiny tile and partition sizes so that a few hundred tokens cross many tiles and
partitions; the kernels' outputs and scratch start as NaN (`nan_filled_empty`, `out=`), so an element a
kernel should write but does not, or scratch the reduction reads but nobody wrote, fails the comparison.
Rows with context_len 0 (padding of CUDA-graph batches) must not crash; their output is not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from tests.engine.interpreted import interpreted_report, nan_filled_empty, report_when_run


def paged_copy(
    keys: list[torch.Tensor], values: list[torch.Tensor], num_blocks: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter per-sequence K/V [len, kv_heads, dim] into shuffled cache blocks; return caches and block tables."""
    from kernels.paged_attention import store_kvcache_reference

    generator = torch.Generator().manual_seed(seed)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(-(-len(k) // block_size) for k in keys)
    block_tables = torch.zeros(len(keys), max_blocks, dtype=torch.int32)
    # slots no sequence owns hold NaN: a kernel that reads one (even to multiply it by 0) fails
    k_cache = torch.full((num_blocks, block_size, *keys[0].shape[1:]), float("nan"), dtype=keys[0].dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for seq, (k, v) in enumerate(zip(keys, values, strict=True)):
        for logical in range(-(-len(k) // block_size)):
            block_tables[seq, logical] = free_blocks.pop()
        positions = torch.arange(len(k))
        slots = block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
        store_kvcache_reference(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, block_tables


class DecodeShape(NamedTuple):
    context_lens: list[int]  # 0: a padding row (not compared)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    tile_tokens: int | None = None  # None: the launcher's rule
    partition_size: int | None = None
    table_width: int | None = None  # block_tables columns (as a CUDA graph's fixed width); None: the longest row's
    index_dtype: torch.dtype = torch.int32  # of block_tables and context_lens


def decode_case(shape: DecodeShape) -> dict[str, torch.Tensor]:
    context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype = shape[:6]
    generator = torch.Generator().manual_seed(1)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in context_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype) for n in context_lens]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3  # a few blocks nobody uses
    k_cache, v_cache, block_tables = paged_copy(keys, values, num_blocks, block_size)
    if shape.table_width is not None:  # padded with block 0, like the unused columns of a graph batch
        block_tables = F.pad(block_tables, (0, shape.table_width - block_tables.shape[1]))
    return dict(
        query=torch.randn(len(context_lens), num_heads, head_dim, generator=generator).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(shape.index_dtype),
        context_lens=torch.tensor(context_lens, dtype=shape.index_dtype),
        keys=keys,
        values=values,
    )


F32, BF16 = torch.float32, torch.bfloat16
DECODE_CASES = {
    # launcher's default tile and partition sizes (one partition: the output written directly)
    "gqa_partial_blocks": DecodeShape([9, 1, 16], 4, 2, 16, 4, F32),
    "mha": DecodeShape([5, 12], 2, 2, 32, 8, F32),
    "head_dim_not_power_of_two": DecodeShape([7], 2, 1, 24, 4, F32),
    "bfloat16": DecodeShape([11, 6], 4, 1, 16, 4, BF16),
    # few programs: the rule picks partitions of 128 tokens (3 here) of two 64-token tiles
    "default_sizes_split": DecodeShape([300, 1, 129], 12, 2, 128, 16, BF16),
    # one partition, many tiles
    "one_partition_many_tiles": DecodeShape([100, 3], 4, 1, 16, 4, BF16, tile_tokens=16, partition_size=128),
    # several partitions of several tiles each; 128 ends exactly on a partition boundary; 19 partitions: more than
    # the reduction sums per step (16)
    "partitions_and_tiles": DecodeShape([300, 77, 128], 4, 2, 32, 4, F32, tile_tokens=16, partition_size=64),
    "partitions_over_a_reduction_chunk": DecodeShape([300, 40], 2, 1, 16, 4, F32, tile_tokens=16, partition_size=16),
    # context_len at, one past and one short of partition boundaries (64, 128)
    "partition_boundaries": DecodeShape([128, 64, 65, 63, 127], 2, 1, 16, 16, F32, tile_tokens=32, partition_size=64),
    # grouped-query ratios 6 (12 query heads over 2 KV heads) and 7 (14 over 2: not a power of two)
    "gqa6_head_dim_128_bfloat16": DecodeShape([200, 33], 12, 2, 128, 16, BF16, tile_tokens=32, partition_size=64),
    "gqa6_float32": DecodeShape([90, 5], 12, 2, 32, 8, F32, tile_tokens=16, partition_size=32),
    "gqa7_head_dim_64": DecodeShape([150, 17], 14, 2, 64, 16, F32, tile_tokens=16, partition_size=32),
    "gqa7_bfloat16": DecodeShape([70], 14, 2, 64, 16, BF16, tile_tokens=32, partition_size=32),
    "head_dim_24_partitions": DecodeShape([90], 2, 1, 24, 4, F32, tile_tokens=16, partition_size=32),
    # padding rows (context_len 0) beside real ones, a block table wider than any context (as in a graph)
    "padded_rows": DecodeShape([37, 0, 20, 0], 4, 2, 16, 4, F32, tile_tokens=16, partition_size=16, table_width=20),
    "padded_rows_one_partition": DecodeShape([0, 37], 4, 2, 16, 4, F32, table_width=12),
    "int64_indices": DecodeShape([70, 5], 4, 2, 16, 8, F32, tile_tokens=16, partition_size=32, index_dtype=torch.int64),
}
CUDA_ONLY_CASES = {  # realistic sizes, the launcher's rule: too slow for the interpreter
    "gqa6_long_contexts": DecodeShape([4000, 1, 513, 0, 2048], 12, 2, 128, 16, BF16),
    "gqa7_long_contexts": DecodeShape([3000, 1500, 7], 14, 2, 64, 16, BF16),
    "gqa6_batch_of_64": DecodeShape([1 + 37 * i for i in range(64)], 12, 2, 128, 16, BF16),
    "gqa7_float32_graph_width": DecodeShape([900, 0, 15], 14, 2, 64, 16, F32, table_width=256),
}


def test_reference_decode_equals_dense_attention() -> None:
    from kernels.paged_attention import paged_attention_decode_reference

    for name, shape in DECODE_CASES.items():
        case = decode_case(shape)
        head_dim, dtype = shape.head_dim, shape.dtype
        scale = head_dim**-0.5
        paged = paged_attention_decode_reference(
            case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"], scale
        )
        for seq, (k, v) in enumerate(zip(case["keys"], case["values"], strict=True)):
            if not len(k):
                continue  # a padding row
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


# -- Triton kernels, interpreted (and natively where CUDA is available) -------------------------------------


def _store_error(slot_dtype: torch.dtype, device: str = "cpu") -> float:
    from kernels.paged_attention import store_kvcache, store_kvcache_reference

    generator = torch.Generator().manual_seed(2)
    key = torch.randn(5, 2, 8, generator=generator)
    value = torch.randn(5, 2, 8, generator=generator)
    slot_mapping = torch.tensor([13, 0, -1, 7, 30], dtype=slot_dtype)
    caches = [torch.full((8, 4, 2, 8), 0.5) for _ in range(4)]
    on_device = [tensor.to(device) for tensor in (key, value, *caches[:2], slot_mapping)]
    store_kvcache(*on_device)
    caches[:2] = [cache.cpu() for cache in on_device[2:4]]
    store_kvcache_reference(key, value, caches[2], caches[3], slot_mapping)
    return max((caches[0] - caches[2]).abs().max().item(), (caches[1] - caches[3]).abs().max().item())


def _decode_error(shape: DecodeShape, device: str = "cpu") -> float:
    """Max error of the Triton decode kernel vs the reference over the real rows (inf if one is not finite):
    absolute for float32; for 16-bit dtypes relative to 1 + |reference| (where the output is above 2, one
    bfloat16 step, 2^-6, is most of the 2e-2 tolerance)."""
    from kernels.paged_attention import paged_attention_decode, paged_attention_decode_reference

    case = decode_case(shape)
    arguments = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"])
    scale = shape.head_dim**-0.5
    out = torch.full(case["query"].shape, float("nan"), dtype=shape.dtype, device=device)
    with nan_filled_empty():
        triton_out = paged_attention_decode(
            *(tensor.to(device) for tensor in arguments),
            scale,
            out=out,
            tile_tokens=shape.tile_tokens,
            partition_size=shape.partition_size,
        )
    assert triton_out is out
    reference = paged_attention_decode_reference(*arguments, scale)
    real = torch.tensor(shape.context_lens) > 0
    triton_rows = triton_out.cpu()[real].float()
    if not triton_rows.isfinite().all():
        return float("inf")
    reference_rows = reference[real].float()
    error = (triton_rows - reference_rows).abs()
    if shape.dtype != torch.float32:
        error /= 1 + reference_rows.abs()
    return error.max().item()


def decode_tolerance(shape: DecodeShape) -> float:
    return 1e-5 if shape.dtype == torch.float32 else 2e-2


INTERPRETED_CASES: dict[str, Callable[[], float]] = {
    "store_int64_slots": lambda: _store_error(torch.int64),
    "store_int32_slots": lambda: _store_error(torch.int32),
    **{f"decode_{name}": (lambda shape=shape: _decode_error(shape)) for name, shape in DECODE_CASES.items()},
}


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    """Error of each Triton case vs its reference (`_store_error`, `_decode_error`), computed in a
    TRITON_INTERPRET=1 subprocess."""
    return interpreted_report(__file__)


@pytest.mark.parametrize("case", [name for name in INTERPRETED_CASES if name.startswith("store")])
def test_triton_store_kvcache_matches_reference(interpreted_errors: dict[str, float], case: str) -> None:
    assert interpreted_errors[case] == 0.0


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_triton_decode_attention_matches_reference(interpreted_errors: dict[str, float], name: str) -> None:
    assert interpreted_errors[f"decode_{name}"] < decode_tolerance(DECODE_CASES[name])


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cuda_store_kvcache_matches_reference(slot_dtype: torch.dtype) -> None:
    assert _store_error(slot_dtype, "cuda") == 0.0


@needs_cuda
@pytest.mark.parametrize("name", [*DECODE_CASES, *CUDA_ONLY_CASES])
def test_cuda_decode_attention_matches_reference(name: str) -> None:
    shape = DECODE_CASES.get(name) or CUDA_ONLY_CASES[name]
    assert _decode_error(shape, "cuda") < decode_tolerance(shape)


@needs_cuda
def test_cuda_decode_attention_replays_in_a_cuda_graph() -> None:
    """Captured once with a fixed block-table width, replayed after lengths, tables and caches change in place."""
    from kernels.paged_attention import paged_attention_decode, paged_attention_decode_reference

    shape = DecodeShape([1500, 0, 700], 12, 2, 128, 16, BF16, table_width=128)
    scale = shape.head_dim**-0.5
    case = decode_case(shape)
    capacity = 3 * 128 + 3  # blocks: enough for every case below (decode_case numbers blocks from 0)
    static = {key: case[key].cuda() for key in ("query", "block_tables", "context_lens")}
    caches = [torch.zeros(capacity, *case["k_cache"].shape[1:], dtype=BF16, device="cuda") for _ in range(2)]

    def run() -> torch.Tensor:
        return paged_attention_decode(static["query"], *caches, static["block_tables"], static["context_lens"], scale)

    run()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run()
    for context_lens in ([1500, 0, 700], [3, 1200, 0], [2048, 17, 512]):  # 2048: the table's full width
        replayed = decode_case(shape._replace(context_lens=context_lens))
        for key in static:
            static[key].copy_(replayed[key])
        for cache, new in zip(caches, (replayed["k_cache"], replayed["v_cache"]), strict=True):
            cache.zero_()
            cache[: len(new)].copy_(new)
        graph.replay()
        arguments = (static["query"], *caches, static["block_tables"], static["context_lens"])
        reference = paged_attention_decode_reference(*(tensor.cpu() for tensor in arguments), scale)
        real = torch.tensor(context_lens) > 0
        torch.testing.assert_close(graph_out.cpu()[real].float(), reference[real].float(), atol=2e-2, rtol=2e-2)


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
    arguments = (torch.randn(1, 2, 16), k_cache, k_cache, torch.zeros(1, 8, dtype=torch.int32), torch.ones(1), 1.0)
    for sizes in (dict(tile_tokens=8), dict(tile_tokens=24), dict(tile_tokens=16, partition_size=24)):
        with pytest.raises(ValueError, match="tile_tokens"):
            paged_attention_decode(*arguments, **sizes)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_decode(*arguments, out=torch.empty(1, 2, 16, dtype=torch.bfloat16))


if __name__ == "__main__":
    # The subprocess side of the fixture: TRITON_INTERPRET=1 is already in the environment.
    report_when_run(lambda: {name: case() for name, case in INTERPRETED_CASES.items()})
