"""Paged KV cache kernels in Triton (the CUDA path) and their PyTorch references (the CPU path).

Layout, per layer: `k_cache`, `v_cache` are [num_blocks, block_size, num_kv_heads, head_dim]
(contiguous; the flat [num_blocks * block_size, num_kv_heads, head_dim] view is the same memory).
Position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

- `store_kvcache`: write this step's K/V rows at `slot_mapping` (int32/int64; slot -1: padding, skipped).
- `paged_attention_decode`: one query token per sequence attends over its first `context_lens[s]`
  cached positions (its own K/V already stored), grouped-query heads sharing KV heads.

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import
to run the kernels on CPU through Triton's interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:  # a padding row
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < ROW_SIZE
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, value, mask=mask)


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    query_stride_seq,
    query_stride_head,
    out_stride_seq,
    out_stride_head,
    block_tables_stride,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two ≥ HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block; one cache block per loop iteration
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    context_len = tl.load(context_lens_ptr + seq)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    query = tl.load(query_ptr + seq * query_stride_seq + head * query_stride_head + dims, mask=dim_mask, other=0.0)
    query = query.to(tl.float32) * scale
    token_offsets = tl.arange(0, BLOCK_SIZE)
    slot_stride = NUM_KV_HEADS * HEAD_DIM

    # online softmax (flash-decoding without the split): running max, running denominator, weighted sum
    running_max = -float("inf")
    denominator = 0.0
    accumulator = tl.zeros([BLOCK_D], dtype=tl.float32)
    for logical_block in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        physical_block = tl.load(block_tables_ptr + seq * block_tables_stride + logical_block).to(tl.int64)
        positions = logical_block * BLOCK_SIZE + token_offsets
        token_mask = positions < context_len
        slots = physical_block * BLOCK_SIZE + token_offsets
        offsets = slots[:, None] * slot_stride + kv_head * HEAD_DIM + dims[None, :]
        tile_mask = token_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * query[None, :], axis=1)
        scores = tl.where(token_mask, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        values = tl.load(v_cache_ptr + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        denominator = denominator * correction + tl.sum(weights, axis=0)
        accumulator = accumulator * correction + tl.sum(weights[:, None] * values, axis=0)
        running_max = new_max

    out = accumulator / denominator
    tl.store(
        out_ptr + seq * out_stride_seq + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
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
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
    context_lens [num_seqs] int32 (≥ 1). Returns [num_seqs, num_heads, head_dim] in query's dtype."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query rows and block_tables rows must be contiguous")
    out = torch.empty_like(query)
    _paged_attention_decode_kernel[(num_seqs, num_heads)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
    return out


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
