"""Block manager: exact block ids, ref counts, prefix-cache hits and LRU eviction."""

from __future__ import annotations

from engines.block_manager import BlockManager
from engines.sampling_params import SamplingParams
from engines.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(temperature=0))


def admit(manager: BlockManager, seq: Sequence) -> list[int]:
    """Allocate the whole sequence (after prefix-cache lookup), mark it computed, register its blocks."""
    computed = manager.get_computed_blocks(seq)
    num_new = seq.num_tokens - len(computed) * manager.block_size
    assert manager.can_allocate(seq, computed, num_new)
    manager.allocate(seq, computed, num_new)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)
    return computed


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def test_allocation_takes_free_blocks_in_order_and_deallocation_returns_them() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    a = make_seq("a", list(range(10)))  # 3 blocks
    b = make_seq("b", list(range(100, 105)))  # 2 blocks
    admit(manager, a)
    admit(manager, b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert manager.num_free_blocks == 3

    manager.deallocate(a)
    assert a.block_table == []
    assert ref_counts(manager) == [0, 0, 0, 1, 1, 0, 0, 0]
    # The never-used blocks come first, then a's blocks, tail first.
    assert list(manager.free_block_ids) == [5, 6, 7, 2, 1, 0]


def test_may_append_adds_a_block_only_when_the_last_one_is_full() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    seq = make_seq("a", [1, 2, 3])
    admit(manager, seq)
    assert seq.block_table == [0]
    seq.append_token(4)  # the 4th token still fits block 0
    assert manager.can_append(seq, 1)
    manager.may_append(seq, 1)
    seq.num_computed_tokens += 1
    assert seq.block_table == [0]
    seq.append_token(5)
    manager.may_append(seq, 1)
    assert seq.block_table == [0, 1]


def test_can_allocate_and_can_append_refuse_when_blocks_run_out() -> None:
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(manager, make_seq("a", list(range(8))))  # 2 blocks
    big = make_seq("b", list(range(9)))
    assert not manager.can_allocate(big, [], 9)
    assert manager.can_allocate(big, [], 4)  # a first chunk fits in the one free block
    manager.allocate(big, [], 4)
    big.num_computed_tokens = 4
    assert not manager.can_append(big, 1)


def test_shared_prefix_reuses_full_blocks_and_counts_references() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # full blocks [1..4] [5..8], partial [9, 10]
    admit(manager, a)
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44])
    assert admit(manager, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == b.num_tokens
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]

    c = make_seq("c", [1, 2, 3, 4, 99, 98, 97, 96])  # diverges in the second block
    assert admit(manager, c) == [0]
    assert ref_counts(manager)[0] == 3


def test_the_last_token_is_never_served_from_the_cache() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    same = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8])
    # Both blocks are cached, but the second holds the last token, which must be computed for logits.
    assert manager.get_computed_blocks(same) == [0]


def test_freed_cached_blocks_are_revived_by_a_later_hit() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(manager, a)
    manager.deallocate(a)
    assert manager.num_free_blocks == 4
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 77])
    computed = manager.get_computed_blocks(b)
    assert computed == [0, 1]
    # Reviving the two cached blocks takes free capacity too: 2 revived + 2 new fit in 4, 2 + 3 do not.
    assert manager.can_allocate(b, computed, 5)
    assert not manager.can_allocate(b, computed, 9)
    manager.allocate(b, computed, 1)
    assert b.block_table == [0, 1, 3]  # the fresh block is the front of the free list: 3, never used
    assert ref_counts(manager) == [1, 1, 0, 1]


def test_eviction_takes_the_least_recently_freed_cached_block_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_seq("a", [1, 2, 3, 4, 0])
    b = make_seq("b", [5, 6, 7, 8, 0])
    admit(manager, a)  # blocks 0 (cached [1..4]), 1
    admit(manager, b)  # blocks 2 (cached [5..8]), 3
    manager.deallocate(a)  # free order: 1, 0
    manager.deallocate(b)  # free order: 1, 0, 3, 2
    assert list(manager.free_block_ids) == [1, 0, 3, 2]

    filler = make_seq("c", [9, 9, 9, 9, 9, 9])  # needs 2 blocks: takes 1 (uncached) then evicts 0 ([1..4])
    admit(manager, filler)
    assert filler.block_table == [0, 1]  # the blocks taken in eviction order, held in ascending order
    assert manager.get_computed_blocks(make_seq("x", [1, 2, 3, 4, 0])) == []  # evicted
    assert manager.get_computed_blocks(make_seq("y", [5, 6, 7, 8, 0])) == [2]  # still cached


def test_a_sequence_reusing_freed_blocks_holds_them_in_ascending_order() -> None:
    # Freed tail first, a sequence's blocks come back in descending order; taken as they come, the next sequence's
    # K/V would lie backwards in memory, which the CPU's decode attention reads at half speed.
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_seq("a", list(range(1, 4 * BLOCK_SIZE)))
    admit(manager, first)
    assert first.block_table == [0, 1, 2, 3]
    manager.deallocate(first)
    assert list(manager.free_block_ids) == [3, 2, 1, 0]

    second = make_seq("b", [7] * (4 * BLOCK_SIZE - 1))
    admit(manager, second)
    assert second.block_table == [0, 1, 2, 3]


def test_a_hit_requires_the_same_tokens_in_every_earlier_block() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: the chained hash differs, so nothing is shared.
    assert manager.get_computed_blocks(make_seq("b", [9, 2, 3, 4, 5, 6, 7, 8, 0])) == []


def test_prefix_caching_disabled_never_hits() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(manager, make_seq("a", [1, 2, 3, 4, 5]))
    assert manager.get_computed_blocks(make_seq("b", [1, 2, 3, 4, 5])) == []



def test_a_shared_prefix_brings_the_drafters_kv_only_where_it_computed_them_since_the_block_was_taken() -> None:
    manager = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    a = make_seq("a", list(range(8)))
    admit(manager, a)
    a.num_draft_computed_tokens = 8  # a speculative drafter computed both blocks
    manager.mark_drafted_blocks(a)
    manager.deallocate(a)
    # Other tokens take both blocks over: what the drafter held there is gone.
    other = make_seq("other", list(range(100, 108)))
    admit(manager, other)
    assert sorted(other.block_table) == [0, 1]
    manager.deallocate(other)
    later = make_seq("later", list(range(100, 108)))
    manager.allocate(later, manager.get_computed_blocks(later), 4)
    assert later.num_computed_tokens == 4 and later.num_draft_computed_tokens == 0
    manager.deallocate(later)

    drafted = make_seq("drafted", list(range(200, 208)))
    admit(manager, drafted)
    drafted.num_draft_computed_tokens = 8
    manager.mark_drafted_blocks(drafted)
    manager.deallocate(drafted)
    again = make_seq("again", list(range(200, 208)))
    manager.allocate(again, manager.get_computed_blocks(again), 4)
    assert again.num_computed_tokens == 4 and again.num_draft_computed_tokens == 4
