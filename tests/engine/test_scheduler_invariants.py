"""Random arrivals, aborts and lengths never break the KV-cache bookkeeping nor lose a sequence."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.block_manager import BlockManager
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler
from engines.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]  # shared prefixes make prefix-cache hits likely

add_op = st.tuples(st.just("add"), st.sampled_from(range(len(PREFIXES))), st.integers(1, 14), st.integers(1, 12))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))
step_op = st.tuples(st.just("step"))
operations = st.lists(st.one_of(add_op, abort_op, step_op, step_op, step_op), max_size=60)


def check_invariants(scheduler: Scheduler, live: list[Sequence]) -> None:
    manager = scheduler.block_manager
    holders = Counter(block_id for seq in scheduler.running for block_id in seq.block_table)
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id], block
        assert (block.block_id in manager.free_block_ids) == (block.ref_count == 0), block
    for block_hash, block_id in manager.hash_to_block_id.items():
        assert manager.blocks[block_id].block_hash == block_hash
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) >= manager.num_blocks_for(seq.num_computed_tokens)
        assert len(set(seq.block_table)) == len(seq.block_table)
    # No sequence lost or duplicated: every live one is queued exactly once.
    queued = [*scheduler.waiting, *scheduler.running]
    assert sorted(id(seq) for seq in queued) == sorted(id(seq) for seq in live)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def step(scheduler: Scheduler, live: list[Sequence]) -> None:
    batch = scheduler.schedule()
    assert batch.num_batched_tokens <= scheduler.max_num_batched_tokens
    for seq in scheduler.advance(batch):
        seq.append_token(len(seq) % 11)  # a fake model: deterministic tokens
        if seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq, "length")
            live.remove(seq)


@settings(max_examples=300, deadline=None)
@given(operations=operations, max_num_seqs=st.integers(1, 4), budget=st.integers(1, 16),
       prefix_caching=st.booleans())
def test_random_workloads_keep_every_block_accounted_for(operations: list[tuple], max_num_seqs: int, budget: int,
                                                         prefix_caching: bool) -> None:
    scheduler = Scheduler(BlockManager(NUM_BLOCKS, BLOCK_SIZE, prefix_caching), max_num_seqs, budget)
    live: list[Sequence] = []
    for number, operation in enumerate(operations):
        if operation[0] == "add":
            _, prefix, suffix_len, max_tokens = operation
            prompt = PREFIXES[prefix] + [100 + number + i for i in range(suffix_len)]
            if scheduler.block_manager.num_blocks_for(len(prompt) + max_tokens) > NUM_BLOCKS:
                continue  # the engine refuses such requests up front
            seq = Sequence(f"r{number}", prompt, SamplingParams(max_tokens=max_tokens))
            scheduler.add(seq)
            live.append(seq)
        elif operation[0] == "abort" and live:
            seq = live.pop(operation[1] % len(live))
            scheduler.finish(seq, "abort")
        else:
            step(scheduler, live)
        check_invariants(scheduler, live)

    # Everything admitted eventually finishes (no livelock under preemption) and every block comes back.
    for _ in range(2000):
        if not live:
            break
        step(scheduler, live)
        check_invariants(scheduler, live)
    assert not live and not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == NUM_BLOCKS
