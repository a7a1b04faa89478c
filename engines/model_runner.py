"""Runs one scheduled step through the model: builds the flat inputs and attention metadata, owns the KV cache."""

from __future__ import annotations

import torch

from engines.attention import AttentionMetadata, PrefillChunk
from engines.config import ModelConfig
from engines.scheduler import ScheduledBatch
from engines.sequence import Sequence


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int, num_kv_blocks: int,
                 kv_cache_dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        shape = (num_kv_blocks * block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_cache_dtype), torch.zeros(shape, dtype=kv_cache_dtype))
                          for _ in range(config.num_hidden_layers)]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the batch; return float32 logits [S, V] for the S sequences that sample this step
        (`batch.sampled`, in that order). Only their last row goes through the LM head.
        """
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)  # decode rows first
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_seqs: list[Sequence] = []
        prefills: list[PrefillChunk] = []
        last_rows: dict[int, int] = {}  # batch index → the row of its last token
        size = self.block_size
        for i in order:
            seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // size] * size + p % size for p in range(start, end))
            if num_new == 1:
                decode_seqs.append(seq)
            else:
                prefills.append(self._prefill_chunk(seq, row, row + num_new))
            last_rows[i] = row + num_new - 1

        metadata = AttentionMetadata(
            block_size=size,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            num_decode_tokens=len(decode_seqs),
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_seqs:
            metadata.decode_block_tables, metadata.decode_mask = self._decode_context(decode_seqs)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                            self.kv_caches, metadata)
        sample_rows = [last_rows[i] for i, samples in enumerate(batch.samples) if samples]
        if not sample_rows:
            return torch.empty(0, self.config.vocab_size), []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows)])
        return logits.float(), batch.sampled

    def _decode_context(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        context_lens = torch.tensor([seq.num_computed_tokens + 1 for seq in seqs])
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        tables = torch.tensor([seq.block_table[:max_blocks] + [0] * (max_blocks - len(seq.block_table[:max_blocks]))
                               for seq in seqs], dtype=torch.long)
        mask = torch.arange(max_blocks * self.block_size).unsqueeze(0) < context_lens.unsqueeze(1)
        return tables, mask[:, None, None, :]

    def _prefill_chunk(self, seq: Sequence, start_row: int, end_row: int) -> PrefillChunk:
        num_computed = seq.num_computed_tokens
        if num_computed == 0:
            return PrefillChunk(start_row, end_row, 0, block_table=None, mask=None)
        num_new = end_row - start_row
        num_blocks = -(-(num_computed + num_new) // self.block_size)
        table = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long)
        # Query i sits at position num_computed + i and sees every key up to that position (and no
        # slot past the chunk's end in its last block).
        key_positions = torch.arange(num_blocks * self.block_size).unsqueeze(0)
        mask = key_positions <= (num_computed + torch.arange(num_new)).unsqueeze(1)
        return PrefillChunk(start_row, end_row, num_computed, block_table=table, mask=mask)
