"""Paged attention in plain PyTorch (CPU first).

The KV cache of one layer is a pair of tensors of shape [num_blocks * block_size, num_kv_heads,
head_dim]: token slot `block_table[p // block_size] * block_size + p % block_size` holds position p.
Each step writes the new tokens' K/V at `slot_mapping`, then attends:
  - decode rows (one query token each) as one padded batch over their gathered context;
  - prefill chunks one by one, causally over the cached prefix plus the chunk itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """Query rows [start, end) of the step belong to one sequence whose first `num_computed` tokens are cached."""

    start: int
    end: int
    num_computed: int
    context_slots: torch.Tensor | None  # [num_computed + end - start] cache slots; None when nothing is cached
    mask: torch.Tensor | None  # [end - start, context length] bool, True = may attend; None when purely causal


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each query attends to; shared by all layers.

    The step's token rows are laid out decode rows first (`num_decode_tokens` of them), then the
    prefill chunks in order.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [num_decode_tokens, max context] long, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decode_tokens, 1, 1, max context] bool
    prefills: list[PrefillChunk]


def context_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` (any shape, last dim indexing `block_table`'s rows) for block tables."""
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a [num_slots, KVH, D] cache and a long index of any shape.

    `index_select` on the flattened index: advanced indexing with a 2-D index is 2-5x slower on CPU.
    """
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] for this step's tokens; returns [T, H, D]."""
    store_kvcache(key, value, k_cache, v_cache, metadata.slot_mapping)
    output = torch.empty_like(query)
    num_decode = metadata.num_decode_tokens
    if num_decode:
        batch, num_heads, head_dim = query[:num_decode].shape
        num_kv_heads = k_cache.shape[1]
        # Query heads sharing a KV head become that head's query rows: no K/V copy per query head.
        q = query[:num_decode].view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k = gather_slots(k_cache, metadata.decode_slots).transpose(1, 2)  # [B, KVH, L, D]
        v = gather_slots(v_cache, metadata.decode_slots).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_mask, scale=scale)
        output[:num_decode] = out.reshape(batch, num_heads, head_dim)
    for chunk in metadata.prefills:
        q = query[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_slots is None:
            k = key[chunk.start:chunk.end]
            v = value[chunk.start:chunk.end]
        else:
            k = gather_slots(k_cache, chunk.context_slots)
            v = gather_slots(v_cache, chunk.context_slots)
        k = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                             scale=scale, enable_gqa=True)
        output[chunk.start:chunk.end] = out.squeeze(0).transpose(0, 1)
    return output
