"""Paged attention in plain PyTorch (CPU first).

The KV cache of one layer is a pair of tensors of shape [num_blocks * block_size, num_kv_heads,
head_dim]: token slot `block_table[p // block_size] * block_size + p % block_size` holds position p.
Each step writes the new tokens' K/V at `slot_mapping`, then attends:
  - decode rows (one query token each) as one padded batch over their gathered context;
  - prefill chunks one by one, causally over the cached prefix plus the chunk itself.
Where this CPU runs `engines.cpu_kernels`, decode rows instead attend in one call that reads the cache
in place through the block tables (`AttentionMetadata.decode_kernel`): no gathered copy, no mask, and
none of the per-op costs that dominate a small decode step. Every decode row of every step takes the
same path, whatever the batch, so a request's output does not depend on its batch mates.
Otherwise context is gathered a whole block at a time (one `index_select` row per block, not per token):
a block of K is one contiguous run of memory, and copying it whole is much faster than slot by
slot, which matters because decode attention on CPU is bound by these copies. Slots past a
sequence's length in its last block (and padding blocks) are masked out.
Where the kernel reads a bfloat16 cache with bfloat16 dot products (`PagedDecodeAttention.attends_prefill`),
prefill chunks take it too, each query token as a decode row over its causal context: faster than SDPA there
(BENCHMARKS.md), and a prompt's tokens attend as its decoded tokens do. On AMX tiles they take
`PagedPrefillAttention`, 16 query rows of a head a tile (`engines.cpu_kernels.prefill_attention` chooses).

On CUDA (`AttentionMetadata.triton`) the K/V store (fused with RoPE, `kernels.rope`) and the decode rows
run Triton kernels over the same cache memory, viewed as [num_blocks, block_size, KVH, D]; prefill
chunks stay on SDPA (PyTorch's flash / memory-efficient kernels): prefill is bound by arithmetic, which those
kernels already do well, and one SDPA call per chunk costs a launch per sequence of the step, not per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.cpu_kernels import PagedDecodeAttention

# (query [T, H, D], k_cache, v_cache [slots, KVH, D], block_tables [T, B], context_lens [T], block_size, scale)
# → [T, H, D]: `PagedDecodeAttention` (CPU) or `triton_decode_attention` (CUDA).
DecodeAttention = PagedDecodeAttention | Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass
class PrefillChunk:
    """Query rows [start, end) of the step belong to one sequence whose first `num_computed` tokens are cached.

    Where `AttentionMetadata.prefill_kernel` is set, the chunk attends through it, reading its context (its own
    rows' K/V included) from the cache through `block_table`."""

    start: int
    end: int
    num_computed: int
    block_table: torch.Tensor | None  # [blocks covering the context] long; None when nothing is cached
    mask: torch.Tensor | None  # [end - start, blocks * block_size] bool, True = may attend; None when purely causal


class ChunkAttention(Protocol):
    """A prefill chunk's causal attention read in place from the paged cache (`engines.cpu_kernels`)."""

    def attend_chunk(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, num_computed: int, block_size: int, scale: float) -> torch.Tensor:
        """query [n, H, D] at positions [num_computed, num_computed + n) → [n, H, D] float32."""


class NativeDecodeRows(Protocol):
    """A step's decode rows prepared for a model's native decode layers (`engines.models.llama.NativeDecoder`)."""

    def run_layer(self, index: int, x: torch.Tensor) -> None:
        """Layer `index` over the decode rows' hidden states x [rows, hidden], in place."""


class StepYielded(Exception):
    """A step given up between two layers because `AttentionMetadata.should_yield` said so. Nothing
    of it is recorded: its sequences keep their blocks and compute the same tokens in a later step (the
    K/V slots it wrote are theirs alone, unregistered, and are written again)."""


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each query attends to; shared by all layers.

    The step's token rows are laid out decode rows first (`num_decode_tokens` of them), then the
    prefill chunks in order.
    """

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode_tokens, max blocks] long, padded with block 0
    decode_mask: torch.Tensor | None  # [num_decode_tokens, 1, 1, max blocks * block_size] bool; None with the kernel
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None = None  # [num_decode_tokens] long: positions each decode row sees
    decode_kernel: DecodeAttention | None = None  # attends decode rows in place; None: PyTorch ops
    should_yield: Callable[[], bool] | None = None  # asked before each layer: True gives the step up (StepYielded)
    native_decode: NativeDecodeRows | None = None  # runs the decode rows' layers natively; None: PyTorch modules
    triton: bool = False  # the Triton path (CUDA): K/V stored with RoPE, decode rows through the Triton kernel
    prefill_kernel: ChunkAttention | None = None  # attends every prefill chunk; None: SDPA

    def prefill_only(self) -> AttentionMetadata:
        """This step's prefill chunks alone, their rows numbered from 0 (for when the decode rows go elsewhere)."""
        n = self.num_decode_tokens
        chunks = [replace(chunk, start=chunk.start - n, end=chunk.end - n) for chunk in self.prefills]
        return AttentionMetadata(self.block_size, self.slot_mapping[n:], 0, None, None, chunks,
                                 should_yield=self.should_yield, triton=self.triton, prefill_kernel=self.prefill_kernel)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache's tokens of `block_tables` ([..., blocks]) in order: [..., blocks * block_size, KVH, D]."""
    num_slots, num_kv_heads, head_dim = cache.shape
    blocks = cache.view(num_slots // block_size, block_size * num_kv_heads * head_dim)
    gathered = blocks.index_select(0, block_tables.reshape(-1))
    return gathered.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, num_kv_heads, head_dim)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def as_blocks(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A flat [slots, KVH, D] cache as the kernels' [num_blocks, block_size, KVH, D] (the same memory)."""
    return cache.view(-1, block_size, *cache.shape[1:])


def triton_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`engines.cpu_kernels.PagedDecodeAttention`'s contract through the Triton decode kernel; written into `out`
    when given (directly where it has the cache's dtype: no copy kernel)."""
    from kernels.paged_attention import paged_attention_decode

    query = query.to(k_cache.dtype)
    direct = out is not None and out.dtype == query.dtype
    result = paged_attention_decode(query, as_blocks(k_cache, block_size), as_blocks(v_cache, block_size),
                                    block_tables, context_lens, scale, out=out if direct else None)
    if out is None:
        return result
    if not direct:
        out.copy_(result)
    return out


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] for this step's tokens; returns [T, H, D] in query's dtype.

    Attention runs in the cache's dtype, for fresh keys too: a prompt gets the same result whether
    its prefix came from the cache or not. On the Triton path this step's K/V are in the cache already: the
    kernel that applies RoPE stores them (`kernels.rope`).
    """
    kv_dtype = k_cache.dtype
    key, value = key.to(kv_dtype), value.to(kv_dtype)
    if not metadata.triton:
        store_kvcache(key, value, k_cache, v_cache, metadata.slot_mapping)
    output = torch.empty_like(query)
    num_decode = metadata.num_decode_tokens
    if num_decode and metadata.triton:
        triton_decode_attention(query[:num_decode], k_cache, v_cache, metadata.decode_block_tables,
                                metadata.decode_context_lens, metadata.block_size, scale, out=output[:num_decode])
    elif num_decode and metadata.decode_kernel is not None:
        output[:num_decode] = metadata.decode_kernel(query[:num_decode], k_cache, v_cache, metadata.decode_block_tables,
                                                     metadata.decode_context_lens, metadata.block_size, scale)
    elif num_decode:
        batch, num_heads, head_dim = query[:num_decode].shape
        num_kv_heads = k_cache.shape[1]
        # Query heads sharing a KV head become that head's query rows: no K/V copy per query head.
        q = query[:num_decode].to(kv_dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k = gather_blocks(k_cache, metadata.decode_block_tables, metadata.block_size).transpose(1, 2)  # [B, KVH, L, D]
        v = gather_blocks(v_cache, metadata.decode_block_tables, metadata.block_size).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_mask, scale=scale)
        output[:num_decode] = out.reshape(batch, num_heads, head_dim)
    for chunk in metadata.prefills:
        if metadata.prefill_kernel is not None:  # the runner gave every chunk its block table for it
            assert chunk.block_table is not None
            output[chunk.start:chunk.end] = metadata.prefill_kernel.attend_chunk(
                query[chunk.start:chunk.end], k_cache, v_cache, chunk.block_table, chunk.num_computed,
                metadata.block_size, scale)
            continue
        q = query[chunk.start:chunk.end].to(kv_dtype).transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.block_table is None:
            k = key[chunk.start:chunk.end]
            v = value[chunk.start:chunk.end]
        else:
            k = gather_blocks(k_cache, chunk.block_table, metadata.block_size)
            v = gather_blocks(v_cache, chunk.block_table, metadata.block_size)
        k = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                             scale=scale, enable_gqa=True)
        output[chunk.start:chunk.end] = out.squeeze(0).transpose(0, 1)
    return output
