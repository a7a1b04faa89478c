"""Paged KV cache kernels in Triton (the CUDA path) and their PyTorch references (the CPU path).

Layout, per layer: `k_cache`, `v_cache` are [num_blocks, block_size, num_kv_heads, head_dim]
(contiguous; the flat [num_blocks * block_size, num_kv_heads, head_dim] view is the same memory).
Position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

- `store_kvcache`: write this step's K/V rows at `slot_mapping` (int32/int64; slot -1: padding, skipped).
- `paged_attention_decode`: one query token per sequence attends over its first `context_lens[s]`
  cached positions (its own K/V already stored), grouped-query heads sharing KV heads.

Decode attention reads every cached K/V byte of the batch once and does little arithmetic per byte, so
it is bound by memory bandwidth, and the kernel is shaped so that each byte is read once, in large tiles:
- One program per (sequence, KV head, partition) handles all the query heads sharing that KV head as
  the rows of one [QP, BLOCK_D] query tile (QP ≥ 16, padded rows masked): a K/V tile loaded once
  serves every head of the group, and the two products (scores = q·kᵀ, acc += p·v) are `tl.dot`s on
  tensor cores. One program per query head would read each KV byte once per query head.
- Each loop step takes a tile of TILE_TOKENS tokens (several cache blocks, their physical ids gathered
  from the block table), for enough bytes in flight per step; online softmax in float32 across steps.
- Split-K ("flash-decoding"): the context is cut into partitions of PARTITION_SIZE tokens, each its own
  program, so that a few long sequences still spread over all multiprocessors. Each program writes its
  running max, softmax denominator and unnormalised output to float32 scratch; a second kernel, one
  program per (sequence, query head), rescales the partitions to a common max and sums them. With one
  partition only, the first kernel normalises and writes the output itself.
- The number of partitions comes from shapes alone (block_tables' width × block_size), never from the
  values of `context_lens`: no host synchronisation, a fixed grid and fixed scratch sizes, so the launch
  can be captured in a CUDA graph and replayed with other lengths. Programs of partitions that start past
  their sequence's length return at once, and the reduction reads only the partitions that hold tokens.
  A row with context_len 0 (padding of a graph batch) reads nothing and its output is undefined (NaN).

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import
to run the kernels on CPU through Triton's interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e)), folded into the scale

# -- Triton kernels --------------------------------------------------------------------------------


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride,
    value_stride,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two ≥ ROW_SIZE
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW_SIZE overflows int32 in big caches
    if slot == -1:  # a padding row
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < ROW_SIZE
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, value, mask=mask)


@triton.jit
def _paged_attention_partition_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]: written only when DIRECT
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32, unnormalised
    partial_max_ptr,  # [num_seqs, num_heads, num_partitions] float32, base-2 logits
    partial_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,  # softmax scale × log2(e)
    num_partitions,
    max_context,  # block_tables' width × BLOCK_SIZE: no position past it is read
    query_stride_seq,
    query_stride_head,
    out_stride_seq,
    out_stride_head,
    block_tables_stride,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    QP: tl.constexpr,  # query rows per program: max(16, next power of two ≥ QUERIES_PER_KV), for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # max(16, next power of two ≥ HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_TOKENS: tl.constexpr,  # tokens per loop step, a multiple of BLOCK_SIZE
    PARTITION_SIZE: tl.constexpr,  # tokens per program, a multiple of TILE_TOKENS
    DIRECT: tl.constexpr,  # one partition: normalise and write `out` here, no scratch, no reduction
    DOT_F32: tl.constexpr,  # the tl.dots in float32 "ieee" (tf32 would cost ~1e-3 of accuracy); see _dot_f32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.minimum(tl.load(context_lens_ptr + seq).to(tl.int32), max_context)
    partition_start = partition * PARTITION_SIZE
    if partition_start >= context_len:  # nothing here; the reduction skips this partition
        return
    partition_end = tl.minimum(partition_start + PARTITION_SIZE, context_len)

    rows = tl.arange(0, QP)
    heads = kv_head * QUERIES_PER_KV + rows  # the query heads of this KV head; rows ≥ QUERIES_PER_KV are padding
    row_mask = rows < QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr + seq * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)  # tl.dot needs both operands in one dtype: the cache's

    tokens = tl.arange(0, TILE_TOKENS)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    head_offset = kv_head * HEAD_DIM + dims
    running_max = tl.full([QP], float("-inf"), tl.float32)
    denominator = tl.zeros([QP], dtype=tl.float32)
    accumulator = tl.zeros([QP, BLOCK_D], dtype=tl.float32)
    for tile_start in range(partition_start, partition_end, TILE_TOKENS):
        positions = tile_start + tokens
        token_mask = positions < partition_end
        # each token's physical block (a tile spans TILE_TOKENS // BLOCK_SIZE blocks); masked: 0, a valid block
        physical_blocks = tl.load(block_table + positions // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        slots = physical_blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head_offset[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        # masked K/V read as 0, never as whatever the unused slots hold (0 × NaN would poison the sums)
        keys = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        values = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)

        if DOT_F32:
            scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(keys))
        scores = scores * qk_scale  # [QP, TILE_TOKENS]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: every tile has a valid token
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        denominator = denominator * correction + tl.sum(weights, axis=1)
        if DOT_F32:
            weighted = tl.dot(weights, values.to(tl.float32), input_precision="ieee")
        else:
            weighted = tl.dot(weights.to(values.dtype), values)
        accumulator = accumulator * correction[:, None] + weighted
        running_max = new_max

    store_mask = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        out = accumulator / denominator[:, None]
        tl.store(
            out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        part = (seq * (NUM_KV_HEADS * QUERIES_PER_KV) + heads) * num_partitions + partition  # [QP]
        tl.store(partial_max_ptr + part, running_max, mask=row_mask)
        tl.store(partial_sum_ptr + part, denominator, mask=row_mask)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], accumulator, mask=store_mask)


@triton.jit
def _paged_attention_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    context_lens_ptr,
    num_partitions,
    max_context,
    out_stride_seq,
    out_stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_BLOCK: tl.constexpr,  # next power of two ≥ num_partitions
    CHUNK: tl.constexpr,  # partitions' outputs summed per loop step (bounds the registers)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.minimum(tl.load(context_lens_ptr + seq).to(tl.int32), max_context)
    used = tl.cdiv(context_len, PARTITION_SIZE)  # partitions past it wrote nothing: never read them
    base = (seq * NUM_HEADS + head) * num_partitions

    # Rescale every partition to the global max: out = Σ 2^(m_p - M) acc_p / Σ 2^(m_p - M) l_p.
    parts = tl.arange(0, PARTITIONS_BLOCK)
    maxes = tl.load(partial_max_ptr + base + parts, mask=parts < used, other=float("-inf"))
    global_max = tl.max(maxes, axis=0)
    sums = tl.load(partial_sum_ptr + base + parts, mask=parts < used, other=0.0)
    denominator = tl.sum(sums * tl.exp2(maxes - global_max), axis=0)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    accumulator = tl.zeros([BLOCK_D], dtype=tl.float32)
    for chunk_start in range(0, used, CHUNK):
        chunk = chunk_start + tl.arange(0, CHUNK)
        chunk_mask = chunk < used
        weights = tl.exp2(tl.load(partial_max_ptr + base + chunk, mask=chunk_mask, other=float("-inf")) - global_max)
        partial = tl.load(
            partial_out_ptr + (base + chunk)[:, None] * HEAD_DIM + dims[None, :],
            mask=chunk_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        accumulator += tl.sum(weights[:, None] * partial, axis=0)
    tl.store(
        out_ptr + seq * out_stride_seq + head * out_stride_head + dims,
        (accumulator / denominator).to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


# -- launchers -------------------------------------------------------------------------------------


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] → caches at `slot_mapping` [num_tokens]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if key.stride(1) != head_dim or key.stride(2) != 1 or value.stride(1) != head_dim or value.stride(2) != 1:
        raise ValueError("key and value rows must be contiguous [num_kv_heads, head_dim] blocks")
    row_size = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW_SIZE=row_size,
        BLOCK=triton.next_power_of_2(row_size),
    )


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    tile_tokens: int | None = None,
    partition_size: int | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] int32/int64;
    context_lens [num_seqs] int32/int64 (0: a padding row, its output undefined).
    Returns [num_seqs, num_heads, head_dim] in query's dtype, written into `out` when given.

    `tile_tokens` (tokens per loop step: a power of two, a multiple of block_size, ≥ 16) and `partition_size`
    (tokens per program: a multiple of tile_tokens) override `default_tile_tokens` and `default_partition_size`;
    tests use small ones to cover many tiles and partitions on tiny inputs. `num_stages` is Triton's
    software-pipelining depth: on the H200, 3 beat 5 where the batch is large (64 sequences × 2048 tokens: 77%
    against 63% of the copy bandwidth for the large tier's heads; `python -m bench.gpu`'s launch sweep in
    BENCHMARKS.md), and no setting won everywhere."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query rows and block_tables rows must be contiguous")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with contiguous rows")
    max_context = block_tables.shape[1] * block_size
    tile_tokens = tile_tokens or default_tile_tokens(block_size, head_dim)
    partition_size = partition_size or default_partition_size(tile_tokens, num_seqs * num_kv_heads, max_context)
    if tile_tokens < 16 or tile_tokens & (tile_tokens - 1) or tile_tokens % block_size or partition_size % tile_tokens:
        raise ValueError(
            f"tile_tokens ({tile_tokens}) must be a power of two, ≥ 16 and a multiple of block_size ({block_size}); "
            f"partition_size ({partition_size}) a multiple of tile_tokens"
        )

    queries_per_kv = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_partitions = max(1, triton.cdiv(max_context, partition_size))  # from shapes only: CUDA-graph safe
    direct = num_partitions == 1
    # per-partition results for the reduction; with one partition, placeholders that no kernel touches
    scratch_shape = (num_seqs, num_heads, num_partitions) if not direct else (1, 1, 1)
    partial_out = torch.empty((*scratch_shape, head_dim), dtype=torch.float32, device=query.device)
    partial_max = torch.empty(scratch_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty(scratch_shape, dtype=torch.float32, device=query.device)
    _paged_attention_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * LOG2E,
        num_partitions,
        max_context,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=queries_per_kv,
        QP=max(16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        TILE_TOKENS=tile_tokens,
        PARTITION_SIZE=partition_size,
        DIRECT=direct,
        DOT_F32=_dot_f32(k_cache.dtype),
        num_warps=4,
        num_stages=num_stages,
    )
    if not direct:
        _paged_attention_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            context_lens,
            num_partitions,
            max_context,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PARTITION_SIZE=partition_size,
            PARTITIONS_BLOCK=triton.next_power_of_2(num_partitions),
            CHUNK=16,
        )
    return out


def _dot_f32(cache_dtype: torch.dtype) -> bool:
    """Whether the products run in float32: for float32 caches, and for bfloat16 ones under Triton's interpreter,
    whose `tl.dot` multiplies the raw uint16 bits that it stores bfloat16 as. Else in the cache's 16-bit dtype."""
    interpreted = not isinstance(_paged_attention_partition_kernel, triton.runtime.JITFunction)
    return cache_dtype not in (torch.float16, torch.bfloat16) or interpreted


def default_tile_tokens(block_size: int, head_dim: int) -> int:
    """Tokens per loop step: 16 KiB of bfloat16 K per tile (64 tokens of head_dim 128, 128 of head_dim ≤ 64),
    bytes enough in flight per step while the [QP, tile] scores and the K/V tiles stay in registers."""
    return max(block_size, 16, min(128, 8192 // max(16, triton.next_power_of_2(head_dim))))


MIN_PROGRAMS = 256  # about two programs per multiprocessor of an H200 (132)


def default_partition_size(tile_tokens: int, num_seqs_x_kv_heads: int, max_context: int) -> int:
    """Tokens per program: 512, halved (down to 128 or one tile) while the grid would have fewer than
    MIN_PROGRAMS programs. A partition writes and the reduction reads QUERIES_PER_KV × head_dim floats per KV
    head, QUERIES_PER_KV / partition_size of its K/V bytes each way (~1% at 512, ~5% at 128 for 6 query heads
    per KV head): smaller partitions only where a few sequences would leave multiprocessors idle.
    From shapes only (block_tables' width, not context_lens), like the grid."""
    partition_size = 512
    while partition_size > max(tile_tokens, 128) and (
        num_seqs_x_kv_heads * triton.cdiv(max_context, partition_size) < MIN_PROGRAMS
    ):
        partition_size //= 2
    return max(partition_size, tile_tokens)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if k_cache.shape[1] & (k_cache.shape[1] - 1):
        raise ValueError(f"block_size must be a power of two, got {k_cache.shape[1]}")


# -- PyTorch references (the CPU path) ---------------------------------------------------------------


def store_kvcache_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping != -1
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep])


def paged_attention_decode_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `paged_attention_decode`, one sequence at a time, in float32."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = query.shape[1] // num_kv_heads
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(query)
    for seq, context_len in enumerate(context_lens.tolist()):
        positions = torch.arange(context_len, device=query.device)
        slots = block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
        keys = flat_k[slots].float().repeat_interleave(queries_per_kv, dim=1)  # [L, H, D]
        values = flat_v[slots].float().repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[seq].float(), keys) * scale
        out[seq] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).to(query.dtype)
    return out
