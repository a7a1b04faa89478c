"""Scheduler policy: token budget, chunked prefill, decode first, max_num_seqs, preemption by recompute."""

from __future__ import annotations

from engines.block_manager import BlockManager
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler
from engines.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 8, max_num_batched_tokens: int = 16,
                   prefix_caching: bool = False, max_batch_tokens_beside_interactive: int = 1) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, max_num_batched_tokens,
                     max_batch_tokens_beside_interactive=max_batch_tokens_beside_interactive)


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, first_token: int = 0) -> Sequence:
    seq = Sequence(request_id, list(range(first_token, first_token + num_prompt_tokens)), SamplingParams())
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule and pretend the model ran: every sequence that completes its tokens gets token 7."""
    batch = scheduler.schedule()
    for seq in scheduler.advance(batch):
        seq.append_token(7)
    return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = add(scheduler, "a", 20)
    assert step(scheduler) == {"a": 8}
    assert step(scheduler) == {"a": 8}
    assert seq.num_output_tokens == 0
    assert step(scheduler) == {"a": 4}
    assert seq.num_output_tokens == 1
    assert step(scheduler) == {"a": 1}  # decode


def test_running_decodes_are_served_before_new_prompts_take_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "a", 3)
    add(scheduler, "b", 4)
    assert step(scheduler) == {"a": 3, "b": 4}
    add(scheduler, "c", 30)
    assert step(scheduler) == {"a": 1, "b": 1, "c": 8}
    add(scheduler, "d", 5)  # waits: c's prefill continues with what the decodes leave
    assert step(scheduler) == {"a": 1, "b": 1, "c": 8}


def test_decodes_come_before_a_running_prefill_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "long", 20)
    assert step(scheduler) == {"long": 8}
    add(scheduler, "short", 2)  # not admitted while "long" uses the whole budget
    assert step(scheduler) == {"long": 8}
    assert step(scheduler) == {"long": 4, "short": 2}
    batch = scheduler.schedule()  # both decode now
    assert [seq.request_id for seq in batch.seqs] == ["long", "short"]


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        add(scheduler, name, 2)
    assert step(scheduler) == {"a": 2, "b": 2}
    assert [seq.request_id for seq in scheduler.waiting] == ["c"]


def test_running_out_of_blocks_preempts_the_latest_admitted_and_recomputes_it_later() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a = add(scheduler, "a", 4)
    b = add(scheduler, "b", 4, first_token=100)
    c = add(scheduler, "c", 7, first_token=200)
    assert step(scheduler) == {"a": 4, "b": 4, "c": 7}
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2, 3])
    # a's and b's blocks are full: each needs a new block for its next token, and none is free.
    assert step(scheduler) == {"a": 1, "b": 1}
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])  # c's blocks, freed tail first
    assert scheduler.num_preempted_total == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_output_tokens == 1  # its generated token is kept and will be recomputed as context
    assert [seq.request_id for seq in scheduler.waiting] == ["c"]


def test_a_step_that_preempted_admits_nothing_new() -> None:
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    a = add(scheduler, "a", 4)
    b = add(scheduler, "b", 4, first_token=100)
    assert step(scheduler) == {"a": 4, "b": 4}
    add(scheduler, "c", 1, first_token=200)  # would fit in the one free block
    # a's next token takes the free block; b then needs one and preempts... itself (the last admitted).
    assert step(scheduler) == {"a": 1}
    assert b.status is SequenceStatus.WAITING
    assert [seq.request_id for seq in scheduler.waiting] == ["b", "c"]
    assert a.block_table == [0, 2]


def test_a_preempted_sequence_reuses_its_own_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, prefix_caching=True)
    add(scheduler, "a", 4)
    b = add(scheduler, "b", 8, first_token=100)
    assert step(scheduler) == {"a": 4, "b": 8}  # a holds 1 block, b 2, one is left
    step(scheduler)  # a takes the last block; b needs a new one for its 9th token -> b preempted
    assert b.status is SequenceStatus.WAITING
    scheduler.finish(scheduler.running[0], "stop")  # a leaves: room again
    assert step(scheduler) == {"b": 1}  # its two full blocks come from the prefix cache; only token 9 is computed
    assert b.num_cached_tokens == 0  # the reported prefix-cache hit is the one of its first admission


def test_finish_frees_blocks_of_running_and_waiting_sequences() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a = add(scheduler, "a", 5)
    b = add(scheduler, "b", 5)
    step(scheduler)
    scheduler.finish(a, "abort")
    scheduler.finish(b, "abort")
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 16
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort"


def test_the_waiting_queue_removes_from_anywhere_and_keeps_its_order() -> None:
    from engines.scheduler import WaitingQueue

    queue = WaitingQueue()
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(5)]
    for seq in seqs:
        queue.append(seq)
    queue.remove(seqs[2])  # an abort of a queued request: no scan of the queue
    preempted = Sequence("p", [1], SamplingParams())
    queue.appendleft(preempted)  # back to the front
    front = queue[0]
    assert front is preempted
    assert list(queue)[1:] == [seqs[0], seqs[1], seqs[3], seqs[4]]
    assert queue.popleft() is front and len(queue) == 4 and queue
    try:
        queue[1]
    except IndexError:
        pass
    else:
        raise AssertionError("only the head is readable")
