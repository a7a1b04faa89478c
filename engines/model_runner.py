"""Runs one scheduled step through the model: builds the flat inputs and attention metadata, owns the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engines.attention import AttentionMetadata, ChunkAttention, DecodeAttention, PrefillChunk, triton_decode_attention
from engines.config import ModelConfig
from engines.cpu_kernels import ForwardCost, paged_decode_attention, prefill_attention
from engines.cuda_graphs import DecodeGraphs
from engines.sampler import GreedyTokens, greedy_tokens
from engines.scheduler import ScheduledBatch
from engines.sequence import Sequence


@dataclass
class TokenSpan:
    """Tokens at positions [start, start + len(token_ids)) of one sequence whose K/V live at `block_table`'s
    slots (positions before `start` are cached). `logits`: which rows go through the LM head.
    `as_decode_rows`: each token attends as a decode row of its own (speculative verification): the
    same attention path as plain decoding. Verified as a causal prefill chunk, 3 of 4 greedy GSM8K
    outputs of the demo models drifted from plain decoding; as decode rows none did (BENCHMARKS.md)."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    logits: Literal["none", "last", "all"] = "last"
    as_decode_rows: bool = False


@dataclass
class ScoredChunk:
    """The logits of every row of a prompt chunk whose request asked for its prompt's logprobs."""

    seq: Sequence
    start: int  # the chunk's first position
    logits: torch.Tensor  # [chunk rows, V] float32


def _split_scored(logits: torch.Tensor, batch: ScheduledBatch, spans: list[TokenSpan]
                  ) -> tuple[torch.Tensor, list[Sequence], list[ScoredChunk]]:  # fmt: skip
    """`forward`'s rows, span by span, as the sampled sequences' last rows and the scored chunks' rows."""
    row, sampled_rows, scored = 0, [], []
    for seq, span, samples in zip(batch.seqs, spans, batch.samples, strict=True):
        num_rows = {"all": len(span.token_ids), "last": 1, "none": 0}[span.logits]
        if span.logits == "all":
            scored.append(ScoredChunk(seq, span.start, logits[row:row + num_rows]))
        if samples:
            sampled_rows.append(row + num_rows - 1)
        row += num_rows
    return logits[sampled_rows], batch.sampled, scored


def _joined(parts: list[torch.Tensor] | list[GreedyTokens]) -> torch.Tensor | GreedyTokens:
    """The outputs of consecutive forwards as one forward's."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    logprobs = [part.logprobs for part in parts]  # type: ignore[union-attr]
    return GreedyTokens(torch.cat([part.token_ids for part in parts]),  # type: ignore[union-attr]
                        None if logprobs[0] is None else torch.cat(logprobs))  # type: ignore[arg-type]


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose pages become resident only when written (calloc'd through numpy; torch.zeros
    writes every byte): a KV cache sized for a full engine costs memory only as it fills.

    Zeros, not garbage: masked-out slots still meet V in the attention product, and 0 x NaN is NaN."""
    element_size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.int16, 4: np.int32}[element_size])
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    """`device`: where the model's weights are; the KV cache and each step's tensors go there too. On CUDA the
    attention runs the Triton kernels and decode steps of up to `cuda_graph_max_batch` rows replay CUDA graphs
    (`engines.cuda_graphs`; 0: eager). `triton_attention` forces the Triton kernels on the CPU too (tests, under
    Triton's interpreter)."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int, num_kv_blocks: int,
                 kv_cache_dtype: torch.dtype, device: torch.device | None = None, max_model_len: int | None = None,
                 cuda_graph_max_batch: int = 0, triton_attention: bool | None = None,
                 batch_invariant: bool = False) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device or torch.device("cpu")
        on_cuda = self.device.type == "cuda"
        self.triton = on_cuda if triton_attention is None else triton_attention
        shape = (num_kv_blocks * block_size, config.num_key_value_heads, config.head_dim)

        def cache() -> torch.Tensor:
            return torch.zeros(shape, dtype=kv_cache_dtype, device=self.device) if on_cuda \
                else lazy_zeros(shape, kv_cache_dtype)

        self.kv_caches = [(cache(), cache()) for _ in range(config.num_hidden_layers)]
        self.decode_attention: DecodeAttention | None = None  # None: decode rows attend through PyTorch ops
        self.prefill_attention: ChunkAttention | None = None  # None: prefill chunks attend through SDPA
        self.native_decoder = None
        self.graphs: DecodeGraphs | None = None
        if self.triton:
            self.decode_attention = triton_decode_attention
        else:
            kernel = paged_decode_attention()
            supported = kernel is not None and kernel.supports(
                config.num_attention_heads, config.num_key_value_heads, config.head_dim, kv_cache_dtype, block_size)
            self.decode_attention = kernel if supported else None
            self.prefill_attention = prefill_attention(config.num_attention_heads, config.num_key_value_heads,
                                                       config.head_dim, kv_cache_dtype, block_size)
            # Decode rows through whole native layers where the model's are int8 weight-only on float32.
            build_native = getattr(model, "native_decoder", None)
            self.native_decoder = None if build_native is None else build_native(self.kv_caches, block_size)
        if on_cuda and cuda_graph_max_batch > 0:
            max_blocks = -(-(max_model_len or config.max_position_embeddings) // block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, cuda_graph_max_batch, max_blocks,
                                       config.vocab_size, self.device, triton_decode_attention)
        # Every token attends as a decode row (`TokenSpan.as_decode_rows`), prompt chunks too: where decode rows
        # are the same bits alone or beside any others (`rows_are_batch_invariant`), a token's logits then do not
        # depend on what it was batched with or how its prompt was chunked or cached (EngineConfig.batch_invariant).
        # Where the native layers compute a row to other bits than the modules (int8 weight-only), prompt tokens always
        # go through them as decode rows (`native_prefill`): on AVX2 no slower than the modules' chunks (BENCHMARKS.md,
        # "prompts through the native layers"), and no row's bits then depend on its step.
        native = self.native_decoder
        self.native_prefill = native is not None and not native.modules_match and self.decode_attention is not None
        if batch_invariant and not self.rows_are_batch_invariant():
            raise ValueError("batch_invariant needs a CPU engine whose decode layers run natively (quantization "
                             "w8a8, int8 or auto on a CPU with AVX2): elsewhere a row's bits depend on the rows "
                             "beside it")
        self.batch_invariant = batch_invariant

    def rows_are_batch_invariant(self) -> bool:
        """Whether a decode row's logits are the same bits alone, beside other rows and beside a prefill chunk: the
        native layers (exact integer sums, per-row activation scales, the decode attention kernel taking each row
        alone). Where the modules compute a row to other bits (int8 weight-only, `modules_match` false), a step of
        more rows than the native layers take runs as several forwards (`_native_forwards`)."""
        return self.device.type == "cpu" and self.native_decoder is not None and self.decode_attention is not None

    @property
    def forward_cost(self) -> ForwardCost:
        """What a decode forward over n rows costs against one row (`best_num_drafts`): the native layers'
        products' where they run, else extra rows taken as free — near the truth for products in tile order on
        AMX (the weight streams once for all rows, `python -m bench.kernels`)."""
        return self.native_decoder.forward_cost if self.native_decoder is not None else ForwardCost()

    def execute(self, batch: ScheduledBatch, should_yield: Callable[[], bool] | None = None, greedy: bool = False,
                with_logprobs: bool = False) -> tuple[torch.Tensor | GreedyTokens, list[Sequence], list[ScoredChunk]]:
        """Compute the batch; return float32 logits [S, V] for the S sequences that sample this step
        (`batch.sampled`, in that order), or with `greedy` (`sampler.greedy_only`) their argmax token ids [S] (and
        with `with_logprobs` their logprobs), and the logits of every row of the chunks that score their prompt
        (`Sequence.scores_prompt`; not with `greedy`). Only the sampled sequences' last row goes through the LM head
        otherwise. `should_yield` is asked before each layer: True gives the step up (raises `StepYielded`; nothing
        is recorded).
        """
        spans = []
        for seq, num_new, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True):
            start = seq.num_computed_tokens
            rows = "all" if seq.scores_prompt else "last" if samples else "none"
            spans.append(TokenSpan(seq.token_ids[start:start + num_new], start, seq.block_table, rows))
        result = self.forward(spans, should_yield, greedy, with_logprobs)
        if not batch.scores_prompt:
            return result, batch.sampled, []
        return _split_scored(result, batch, spans)

    @torch.inference_mode()
    def forward(self, spans: list[TokenSpan], should_yield: Callable[[], bool] | None = None,
                greedy: bool = False, with_logprobs: bool = False) -> torch.Tensor | GreedyTokens:
        """Compute every span's tokens (writing their K/V); return float32 logits of the rows the spans ask
        for, span by span in the order given: [sum of each span's 0, 1 or len(token_ids) rows, V]; with `greedy`
        each such row's argmax token id instead, and with `with_logprobs` its logprob (from the LM head's own pass
        where the model can: no logits)."""
        if (groups := self._native_forwards(spans)) is not None:
            return _joined([self._forward(group, should_yield, greedy, with_logprobs) for group in groups])
        return self._forward(spans, should_yield, greedy, with_logprobs)

    def _native_forwards(self, spans: list[TokenSpan]) -> list[list[TokenSpan]] | None:
        """A step's spans cut into forwards of at most the native layers' rows, in order, where every token is a decode
        row and the modules would compute more rows to other bits; None where one forward keeps every row's bits. A
        later forward's rows attend to the K/V an earlier one wrote, as a later decode step's would."""
        native = self.native_decoder
        if native is None or native.modules_match or not self.prompts_as_decode_rows:
            return None
        limit = native.max_rows
        if sum(len(span.token_ids) for span in spans) <= limit:
            return None
        groups: list[list[TokenSpan]] = [[]]
        room = limit
        for span in spans:
            begin = 0
            while begin < len(span.token_ids):
                if not room:
                    groups.append([])
                    room = limit
                end = min(len(span.token_ids), begin + room)
                last = end == len(span.token_ids)
                logits = span.logits if span.logits != "last" or last else "none"
                groups[-1].append(TokenSpan(span.token_ids[begin:end], span.start + begin, span.block_table, logits))
                room -= end - begin
                begin = end
        return groups

    def _forward(self, spans: list[TokenSpan], should_yield: Callable[[], bool] | None, greedy: bool,
                 with_logprobs: bool) -> torch.Tensor | GreedyTokens:
        order = sorted(range(len(spans)), key=lambda i: not self._decodes(spans[i]))  # decode rows first
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_spans: list[TokenSpan] = []
        prefills: list[PrefillChunk] = []
        logit_rows: dict[int, list[int]] = {}
        size = self.block_size
        for i in order:
            span = spans[i]
            num_new = len(span.token_ids)
            start, end = span.start, span.start + num_new
            row = len(input_ids)
            input_ids.extend(span.token_ids)
            positions.extend(range(start, end))
            table = span.block_table
            slot_mapping.extend(table[p // size] * size + p % size for p in range(start, end))
            if num_new == 1:
                decode_spans.append(span)
            elif self._decodes(span):
                decode_spans.extend(TokenSpan([token], start + j, table) for j, token in enumerate(span.token_ids))
            else:
                prefills.append(self.prefill_chunk(span, row))
            if span.logits == "last":
                logit_rows[i] = [row + num_new - 1]
            elif span.logits == "all":
                logit_rows[i] = list(range(row, row + num_new))

        rows = [row for i in range(len(spans)) for row in logit_rows.get(i, ())]
        graphs = self.graphs
        # A captured step cannot be given up between layers (`should_yield`); it lasts a few milliseconds.
        if graphs is not None and decode_spans and not prefills and len(decode_spans) <= graphs.max_batch:
            logits = graphs.run(input_ids, positions, slot_mapping, [span.block_table for span in decode_spans],
                                [span.start + 1 for span in decode_spans])
            logits = logits if rows == list(range(len(decode_spans))) else logits[self._tensor(rows)]
            return greedy_tokens(logits, with_logprobs) if greedy else logits
        metadata = AttentionMetadata(
            block_size=size,
            slot_mapping=self._tensor(slot_mapping),
            num_decode_tokens=len(decode_spans),
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
            should_yield=should_yield,
            triton=self.triton,
            prefill_kernel=self.prefill_attention,
        )
        if decode_spans:
            self._decode_context(decode_spans, metadata)
            native = self.native_decoder
            # Beside a prefill chunk, decode rows join its rows through the modules where those give them the
            # same bits (`modules_match`): each layer's weights are then read once for all the step's rows.
            if native is not None and metadata.decode_kernel is not None and len(decode_spans) <= native.max_rows \
                    and not (prefills and native.modules_match):
                metadata.native_decode = native.rows(
                    torch.tensor([span.start for span in decode_spans], dtype=torch.long),
                    metadata.slot_mapping[:len(decode_spans)], metadata.decode_block_tables,
                    metadata.decode_context_lens)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_caches, metadata)
        if not rows:
            logits = torch.empty(0, self.config.vocab_size, device=self.device)
            return greedy_tokens(logits, with_logprobs) if greedy else logits
        hidden = hidden[self._tensor(rows)]
        # The LM head's fold sums a row's log-sum-exp in another order than `logprob_rows`, which steps with sampled
        # rows (and speculative rounds) report from: a batch-invariant engine takes every logprob from the latter.
        head_may_choose = greedy and not (with_logprobs and self.batch_invariant)
        if head_may_choose and (chosen := self.model.greedy_tokens(hidden, with_logprobs)) is not None:
            return chosen
        logits = self.model.compute_logits(hidden).float()
        return greedy_tokens(logits, with_logprobs) if greedy else logits

    @property
    def prompts_as_decode_rows(self) -> bool:
        """Whether every token attends as a decode row, prompt chunks too: in a batch-invariant engine, and through
        native layers that are other bits than the modules (`native_prefill`)."""
        return self.batch_invariant or self.native_prefill

    def _decodes(self, span: TokenSpan) -> bool:
        """Whether the span's tokens attend as decode rows: one token, a verification, or any where prompts do."""
        return len(span.token_ids) == 1 or span.as_decode_rows or self.prompts_as_decode_rows

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """A step's int64 index tensor on the runner's device."""
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _decode_context(self, spans: list[TokenSpan], metadata: AttentionMetadata) -> None:
        """The decode rows' block tables, and their context lengths (for the kernel) or mask (for SDPA)."""
        context_lens = [span.start + 1 for span in spans]
        max_blocks = -(-max(context_lens) // self.block_size)
        metadata.decode_block_tables = self._tensor(
            [span.block_table[:max_blocks] + [0] * (max_blocks - len(span.block_table[:max_blocks])) for span in spans])
        if self.decode_attention is not None:
            metadata.decode_context_lens, metadata.decode_kernel = self._tensor(context_lens), self.decode_attention
            return
        mask = torch.arange(max_blocks * self.block_size).unsqueeze(0) < torch.tensor(context_lens).unsqueeze(1)
        metadata.decode_mask = mask[:, None, None, :].to(self.device)

    def prefill_chunk(self, span: TokenSpan, start_row: int) -> PrefillChunk:
        """How the span's tokens (the step's rows from `start_row`) attend, as a prefill chunk on this runner."""
        num_computed, num_new = span.start, len(span.token_ids)
        end_row = start_row + num_new
        if self.prefill_attention is not None:  # the kernel reads the chunk's context from the cache: no mask
            table = self._tensor(span.block_table[:-(-(num_computed + num_new) // self.block_size)])
            return PrefillChunk(start_row, end_row, num_computed, block_table=table, mask=None)
        if num_computed == 0:
            return PrefillChunk(start_row, end_row, 0, block_table=None, mask=None)
        num_blocks = -(-(num_computed + num_new) // self.block_size)
        table = self._tensor(span.block_table[:num_blocks])
        # Query i sits at position num_computed + i and sees every key up to that position (and no
        # slot past the chunk's end in its last block).
        key_positions = torch.arange(num_blocks * self.block_size, device=self.device).unsqueeze(0)
        mask = key_positions <= (num_computed + torch.arange(num_new, device=self.device)).unsqueeze(1)
        return PrefillChunk(start_row, end_row, num_computed, block_table=table, mask=mask)
