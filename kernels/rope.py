"""RoPE on a step's queries and keys, and the K/V store, in one Triton kernel (the CUDA path); its PyTorch reference.

The attention layer's q/k/v projection is one matmul whose rows hold [q heads | k heads | v heads]. PyTorch then
copies q and k out of it, rotates them (a roll, two products and a sum) and a second kernel writes k and v into
the paged cache: six kernels a layer, where a GPU decode step is bound by its kernel count. This is one program
per token: it rotates the token's q and k heads (HF's non-interleaved "rotate half", with `signed_sin` holding
-sin in its first half, as `engines.models.llama.apply_rope` does, each product and the sum rounded to the
activation dtype as PyTorch rounds them), writes q and k out, and stores k and v at the token's KV slot (slot -1:
a padding row, not stored). The cache layout is `kernels.paged_attention`'s.

`@triton.jit` reads `TRITON_INTERPRET` when this module is imported: set it to 1 before the import to run the
kernel on CPU through Triton's interpreter (tests do this in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_and_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    qkv_stride,
    rope_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # even: the two halves rotate into each other
    HEADS_BLOCK: tl.constexpr,  # next power of two ≥ NUM_HEADS + NUM_KV_HEADS
    KV_BLOCK: tl.constexpr,  # next power of two ≥ NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two ≥ HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & dim_mask[None, :]
    row = qkv_ptr + token * qkv_stride
    x = tl.load(row + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM  # x.roll(HEAD_DIM / 2) along each head
    x_rolled = tl.load(row + heads[:, None] * HEAD_DIM + rolled[None, :], mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * rope_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * rope_stride + dims, mask=dim_mask, other=0.0).to(tl.float32)
    first = (x.to(tl.float32) * cos[None, :]).to(dtype)
    second = (x_rolled.to(tl.float32) * sin[None, :]).to(dtype)
    rotated = (first.to(tl.float32) + second.to(tl.float32)).to(dtype)

    is_query = (heads < NUM_HEADS)[:, None]
    tl.store(q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :], rotated,
             mask=mask & is_query)
    kv_heads = heads - NUM_HEADS  # the key rows of the tile (negative for query rows: masked)
    key_offsets = kv_heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_out_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + key_offsets, rotated, mask=mask & ~is_query)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot != -1:
        row_size = NUM_KV_HEADS * HEAD_DIM
        tl.store(k_cache_ptr + slot * row_size + key_offsets, rotated.to(k_cache_ptr.dtype.element_ty),
                 mask=mask & ~is_query)
        value_heads = tl.arange(0, KV_BLOCK)
        value_offsets = value_heads[:, None] * HEAD_DIM + dims[None, :]
        value_mask = (value_heads < NUM_KV_HEADS)[:, None] & dim_mask[None, :]
        value = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + value_offsets, mask=value_mask, other=0.0)
        tl.store(v_cache_ptr + slot * row_size + value_offsets, value.to(v_cache_ptr.dtype.element_ty),
                 mask=value_mask)


def rope_and_store_kvcache(
    qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) · D] (rows contiguous), cos / signed_sin [T, D] (rows contiguous, any float dtype), caches
    [num_blocks, block_size, KVH, D] → (q [T, H, D] and k [T, KVH, D] rotated, v [T, KVH, D] a view of qkv), with
    k and v stored at `slot_mapping` [T] (-1: not stored)."""
    num_tokens, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1 or head_dim % 2:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * head_dim}] with contiguous rows and "
                         f"head_dim even, got {tuple(qkv.shape)}")
    if cos.stride(-1) != 1 or signed_sin.stride() != cos.stride():
        raise ValueError("cos and signed_sin must be [T, head_dim] with contiguous rows")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or not k_cache.is_contiguous() or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be contiguous [num_blocks, block_size, {num_kv_heads}, {head_dim}]")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    if num_tokens:
        _rope_and_store_kernel[(num_tokens,)](
            qkv, cos, signed_sin, q, k, k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_BLOCK=triton.next_power_of_2(num_heads + num_kv_heads),
            KV_BLOCK=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return q, k, v


def rope_and_store_kvcache_reference(
    qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `rope_and_store_kvcache`, as `engines.models.llama` computes it unfused."""
    from kernels.paged_attention import store_kvcache_reference

    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk = qk.reshape(num_tokens, num_heads + num_kv_heads, head_dim)
    cos, signed_sin = cos.to(qkv.dtype).unsqueeze(1), signed_sin.to(qkv.dtype).unsqueeze(1)
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * signed_sin
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    store_kvcache_reference(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)
    return q.contiguous(), k.contiguous(), v
