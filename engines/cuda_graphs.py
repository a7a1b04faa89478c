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
    """Decode-only steps of up to `max_batch` rows through captured graphs: embedding, layers, final norm and
    the LM head, logits out in float32.

    A step's inputs (token ids, positions, KV slots, context lengths, block tables) reach the device in one
    copy: a pinned host buffer laid out like the graphs' static input buffer, filled from the step's lists.
    On a machine where each launch costs tens of microseconds (a GPU in a VM) seven small copies per step
    would cost more than the step's arithmetic."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], block_size: int, max_batch: int,
                 max_blocks: int, vocab_size: int, device: torch.device, decode_attention: DecodeAttention) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.buckets = batch_buckets(max_batch)
        # [input_ids | positions | slot_mapping | context_lens | block_tables (max_batch × max_blocks)]
        size = max_batch * (4 + max_blocks)
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=True)
        self._host_view = self._host.numpy()
        self._inputs = torch.zeros(size, dtype=torch.long, device=device)
        self._copied = torch.cuda.Event()  # the host buffer may be refilled once the last copy has left it
        input_ids, positions, slot_mapping, context_lens = self._inputs[:4 * max_batch].view(4, max_batch)
        block_tables = self._inputs[4 * max_batch:].view(max_batch, max_blocks)
        self.logits = torch.zeros(max_batch, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        with torch.inference_mode():
            slot_mapping.fill_(-1)
            for rows in reversed(self.buckets):
                metadata = AttentionMetadata(
                    block_size=block_size, slot_mapping=slot_mapping[:rows], num_decode_tokens=rows,
                    decode_block_tables=block_tables[:rows], decode_mask=None, prefills=[],
                    decode_context_lens=context_lens[:rows], decode_kernel=decode_attention, triton=True)

                def forward(rows: int = rows, metadata: AttentionMetadata = metadata) -> None:
                    hidden = model(input_ids[:rows], positions[:rows], kv_caches, metadata)
                    self.logits[:rows] = model.compute_logits(hidden).float()

                forward()  # warm-up outside the capture: compiles the Triton kernels, sets up cuBLAS workspaces
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    forward()
                pool = graph.pool()
                self.graphs[rows] = graph
        torch.cuda.synchronize(device)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] float32 of a decode-only step of at most `max_batch` rows, one row per token (a
        view of the graphs' output buffer: valid until this object's next `run`)."""
        rows, batch, width = len(input_ids), self.max_batch, self.max_blocks
        bucket = next(size for size in self.buckets if size >= rows)
        self._copied.synchronize()
        host = self._host_view
        host[:4 * batch] = 0
        host[2 * batch:3 * batch] = -1  # padding rows store no K/V ...
        host[:rows] = input_ids
        host[batch:batch + rows] = positions
        host[2 * batch:2 * batch + rows] = slot_mapping
        host[3 * batch:3 * batch + rows] = context_lens  # ... and attend to nothing (context length 0)
        tables = host[4 * batch:].reshape(batch, width)
        for row, table in enumerate(block_tables):
            used = table[:width]
            tables[row, :len(used)] = used
        used = 4 * batch + rows * width  # the bucket's padding rows read no block table
        self._inputs[:used].copy_(self._host[:used], non_blocking=True)
        self._copied.record()
        self.graphs[bucket].replay()
        return self.logits[:rows]
