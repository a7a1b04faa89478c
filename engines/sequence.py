"""One request's state inside the engine: its tokens, where their KV lives, and how far it got."""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engines.detokenizer import IncrementalDetokenizer
    from engines.outputs import TokenLogprob
    from engines.structured import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request's tokens (prompt then output) and its KV-cache bookkeeping.

    `num_computed_tokens` counts tokens whose K/V are in the cache (the scheduler's progress
    marker; reset to 0 on preemption). `num_cached_tokens` counts prompt tokens that were served
    from the prefix cache when the request was first admitted (reported to the caller).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 detokenizer: IncrementalDetokenizer | None = None) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Speculative decoding: leading tokens whose K/V the drafter holds. It lags num_computed_tokens by the
        # tokens it has not caught up on (a prompt until its first round, tokens decoded while rounds were declined).
        self.num_draft_computed_tokens = 0
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, extended lazily by the block manager.
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.params = params
        self.generator = generator  # per-request RNG: same seed, same samples, whatever the batch
        self.detokenizer = detokenizer  # output text as tokens come, and stop-string matches
        self.grammar: GrammarState | None = None  # constrained decoding: where the output is in its grammar
        self.finish_reason: str | None = None
        self.was_admitted = False  # prefix-cache statistics are counted on the first admission only
        # With `params.prompt_logprobs`: one per prompt token scored so far, the first None (nothing comes before it).
        self.prompt_logprobs: list[TokenLogprob | None] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def scores_prompt(self) -> bool:
        """The next chunk's rows go through the LM head to score the prompt: its logprobs were asked for, not all
        scored yet (a preempted sequence computes its prompt again), and positions whose next token is a prompt
        token are yet to compute (position p's logits score token p + 1)."""
        return (self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
                and self.num_computed_tokens < self.num_prompt_tokens - 1)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
