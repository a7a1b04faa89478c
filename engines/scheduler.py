"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Every step has a token budget (`max_num_batched_tokens`). Running sequences are served first,
decodes before prefill chunks, so that admitting new work never stalls inter-token latency; the
rest of the budget admits waiting sequences (FCFS), whose prompts are prefilled in chunks across
steps when they do not fit. When the KV cache runs out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later (its prefix may still be
in the prefix cache), so memory pressure slows the engine down but never crashes it.

Priority classes (`SamplingParams.priority`): waiting interactive sequences are admitted before
any waiting batch sequence, and an interactive sequence that finds the slots or the KV blocks held
by running batch sequences preempts them (latest admitted first) rather than wait; under memory
pressure batch sequences are the first to go. Batch work fills what interactive work leaves: while an
interactive sequence waits or prefills, batch sequences sit the step out (keeping their blocks), so
a new interactive prompt is prefilled at the speed it would be without the batch; beside interactive
decodes a step takes at most `max_batch_tokens_beside_interactive` batch tokens; and a step of batch
work alone may be given up between layers when an interactive request arrives
(`ScheduledBatch.yields_to_interactive`), so that request never waits for a long batch prefill. On a
CPU the cost of a step grows with every row in it, and time to first token is the latency users feel
first.

The scheduler is also the one place that decides, for each step, which sequences sample a token
(those whose step completes their tokens: `ScheduledBatch.sampled`) and which finish
(`postprocess`: a stop token, a stop string, or `max_tokens`), as nano-vllm's scheduler does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engines.block_manager import BlockManager
from engines.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The work of one step: `num_new_tokens[i]` tokens of `seqs[i]`, starting at its `num_computed_tokens`.

    `samples[i]`: the step completes `seqs[i]`'s tokens, so a token is sampled for it (a prefill
    chunk that stops mid-prompt samples none). Fixed when the batch is made, before it runs."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = [
            seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(self.seqs, self.num_new_tokens, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def yields_to_interactive(self) -> bool:
        """Every sequence in the step is batch work: interactive work that arrives while it runs may cut it
        short (`LLMEngine.step`), so that a new interactive prompt never waits for a batch step to end."""
        return bool(self.seqs) and all(is_batch(seq) for seq in self.seqs)

    @property
    def scores_prompt(self) -> bool:
        """Some sequence's chunk scores its prompt (`Sequence.scores_prompt`): the step needs logits, not ids."""
        return any(seq.scores_prompt for seq in self.seqs)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that sample a token this step, in batch order."""
        return [seq for seq, samples in zip(self.seqs, self.samples, strict=True) if samples]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Iterable[int] = (), max_batch_tokens_beside_interactive: int = 1) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_batch_tokens_beside_interactive) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_batch_tokens_beside_interactive must be "
                             ">= 1")
        self.max_batch_tokens_beside_interactive = max_batch_tokens_beside_interactive
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preempted_total = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        seqs: list[Sequence] = []
        num_new_tokens: list[int] = []
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()  # ids of scheduled sequences
        made_room = self._preempt_batch_for_interactive()
        num_preempted_before = self.num_preempted_total
        batch_sits_out = self._interactive_prefill_pending()
        interactive_running = any(is_interactive(seq) for seq in self.running)
        batch_budget = self.max_batch_tokens_beside_interactive if interactive_running else budget

        def room(seq: Sequence) -> int:
            return min(budget, batch_budget) if is_batch(seq) else budget

        # Interactive before batch within each (a stable sort): batch sequences not yet scheduled are the
        # ones `_make_room` can still preempt.
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        for seq in sorted(decoding, key=is_batch) + sorted(prefilling, key=is_batch):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or (is_batch(seq) and (batch_sits_out or batch_budget == 0)):
                continue  # preempted earlier in this loop, or leaves the step to interactive work
            num_new = min(seq.num_tokens - seq.num_computed_tokens, room(seq))
            if not self._make_room(seq, num_new, scheduled):
                continue
            self.block_manager.may_append(seq, num_new)
            seqs.append(seq)
            num_new_tokens.append(num_new)
            scheduled.add(id(seq))
            budget -= num_new
            batch_budget -= num_new if is_batch(seq) else 0
        preempted = self.num_preempted_total > num_preempted_before

        # New work only when nothing had to give way this step: otherwise admissions would thrash (and
        # batch sequences preempted for an interactive one wait at least a step).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if is_batch(seq) and (made_room or batch_sits_out or batch_budget == 0):
                break
            computed_blocks = self.block_manager.get_computed_blocks(seq)
            num_computed = len(computed_blocks) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_computed, room(seq))
            if not self.block_manager.can_allocate(seq, computed_blocks, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, computed_blocks, num_new)
            if not seq.was_admitted:
                seq.was_admitted = True
                seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
                self.prefix_cache_queries_tokens += seq.num_prompt_tokens
                self.prefix_cache_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new_tokens.append(num_new)
            budget -= num_new
            batch_budget -= num_new if is_batch(seq) else 0
        return ScheduledBatch(seqs, num_new_tokens)

    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """Record that the batch was computed; return the sequences that now need a sampled token."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_computed_blocks(seq)
        return batch.sampled

    def postprocess(self, batch: ScheduledBatch, token_ids: Seq[int]) -> list[str]:
        """Record a computed step: every sequence advances, each of `batch.sampled` takes its sampled
        token, and those the token ends are finished. Returns the text each token adds."""
        return [self._append(seq, token_id) for seq, token_id in zip(self.advance(batch), token_ids, strict=True)]

    def append_tokens(self, seq: Sequence, token_ids: Seq[int]) -> tuple[int, str]:
        """Append the tokens of one speculative round (computed and advanced by the speculator) in order,
        up to the one that finishes `seq`. Returns how many were taken and the text they add."""
        texts = []
        for token_id in token_ids:
            texts.append(self._append(seq, token_id))
            if seq.is_finished:
                break
        return len(texts), "".join(texts)

    def _append(self, seq: Sequence, token_id: int) -> str:
        """Append a sampled token (advancing the sequence's grammar) and finish `seq` if it ends it: a stop
        token (never part of the text), a stop string (the detokenizer matches it), a complete grammar, or
        `max_tokens` reached."""
        params, detokenizer = seq.params, seq.detokenizer
        assert detokenizer is not None, "sequences that sample carry a detokenizer"
        seq.append_token(token_id)
        if seq.grammar is not None:
            seq.grammar.accept(token_id)
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish(seq, "stop")
            return detokenizer.flush()
        text = detokenizer.add_token(token_id)
        if detokenizer.stopped:
            self.finish(seq, "stop")
        elif seq.grammar is not None and seq.grammar.terminated:
            self.finish(seq, "stop")  # the grammar is complete and allows nothing more
            text += detokenizer.flush()
        elif seq.num_output_tokens >= params.max_tokens:
            self.finish(seq, "length")
            text += detokenizer.flush()
        return text

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _interactive_prefill_pending(self) -> bool:
        """Whether an interactive sequence waits for admission or has prompt tokens left to compute."""
        return bool(self.waiting.count("interactive")) or any(
            is_interactive(seq) and seq.num_tokens - seq.num_computed_tokens > 1 for seq in self.running)

    def _preempt_batch_for_interactive(self) -> bool:
        """Preempt running batch sequences, latest admitted first, until the interactive sequence at the
        head of the queue has a slot and the blocks for its first chunk; whether any was preempted."""
        if not self.waiting or not is_interactive(seq := self.waiting[0]):
            return False
        manager, preempted = self.block_manager, False
        computed_blocks = manager.get_computed_blocks(seq)
        num_new = min(seq.num_tokens - len(computed_blocks) * manager.block_size, self.max_num_batched_tokens)
        while len(self.running) >= self.max_num_seqs or not manager.can_allocate(seq, computed_blocks, num_new):
            victim = next((s for s in reversed(self.running) if not is_interactive(s)), None)
            if victim is None:
                break
            self._preempt(victim)
            preempted = True
        return preempted

    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[int]) -> bool:
        """Preempt running sequences, batch ones first, latest admitted first, until `seq` can grow; False if
        `seq` itself went."""
        while not self.block_manager.can_append(seq, num_new):
            candidates = [s for s in reversed(self.running) if s is not seq and id(s) not in scheduled]
            victim = next((s for s in candidates if not is_interactive(s)), candidates[0] if candidates else None)
            if victim is None:
                self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted_total += 1


def is_interactive(seq: Sequence) -> bool:
    return seq.params.priority == "interactive"


def is_batch(seq: Sequence) -> bool:
    return seq.params.priority == "batch"


class WaitingQueue:
    """Sequences waiting for admission: interactive ones first, each class first in first out, with
    O(1) removal from anywhere (an abort of a queued request costs the same however long the queue
    is). A preempted sequence goes back to the front of its class."""

    def __init__(self) -> None:
        self._interactive: OrderedDict[int, Sequence] = OrderedDict()
        self._batch: OrderedDict[int, Sequence] = OrderedDict()

    def _queue(self, seq: Sequence) -> OrderedDict[int, Sequence]:
        return self._interactive if is_interactive(seq) else self._batch

    def append(self, seq: Sequence) -> None:
        self._queue(seq)[id(seq)] = seq

    def appendleft(self, seq: Sequence) -> None:
        queue = self._queue(seq)
        queue[id(seq)] = seq
        queue.move_to_end(id(seq), last=False)

    def popleft(self) -> Sequence:
        return (self._interactive or self._batch).popitem(last=False)[1]

    def remove(self, seq: Sequence) -> None:
        del self._queue(seq)[id(seq)]

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("only the head of the waiting queue is read")
        return next(iter((self._interactive or self._batch).values()))

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    def count(self, priority: str) -> int:
        """Sequences of one class waiting (the queue depth an autoscaler reads)."""
        return len(self._interactive if priority == "interactive" else self._batch)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([*self._interactive.values(), *self._batch.values()])
