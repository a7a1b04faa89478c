"""Decode steps replayed from CUDA graphs (CUDA only), as vLLM and nano-vllm do.

A decode step launches some fifteen kernels per layer from Python; at small batches on a GPU those launches,
not the weights' bytes, would set the step's time. So each batch-size bucket's forward (embedding, layers,
final norm) is captured once into a CUDA graph over static input buffers, and a step copies its rows into
the buffers and replays its bucket's graph. Rows past the step's own (up to the bucket's size) are padding:
KV slot -1 (the store kernel skips it) and context length 0 (they attend to nothing); every row is computed
on its own, so padding never reaches a real row. The graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import torch

from engines.attention import AttentionMetadata, DecodeAttention

KVCache = tuple[torch.Tensor, torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: powers of two up to 8, then every multiple of 16, and `max_batch` itself."""
    buckets = [size for size in (1, 2, 4, 8) if size < max_batch] + list(range(16, max_batch, 16))
    return [*buckets, max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], block_size: int, max_batch: int,
                 max_blocks: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 decode_attention: DecodeAttention) -> None:
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.buckets):
                metadata = AttentionMetadata(
                    block_size=block_size, slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                    decode_block_tables=self.block_tables[:size], decode_mask=None, prefills=[],
                    decode_context_lens=self.context_lens[:size], decode_kernel=decode_attention, triton=True)
                # Warm-up outside the capture: compiles the Triton kernels, sets up cuBLAS workspaces.
                self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states [rows, hidden] of a decode-only step of at most `max_batch` rows (a view of the
        graphs' output buffer: valid until the next replay)."""
        rows = input_ids.shape[0]
        size = next(bucket for bucket in self.buckets if bucket >= rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:rows].copy_(slot_mapping)
        self.context_lens.zero_()
        self.context_lens[:rows].copy_(context_lens)
        self.block_tables[:rows, :block_tables.shape[1]].copy_(block_tables)
        self.graphs[size].replay()
        return self.hidden[:rows]
