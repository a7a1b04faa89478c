"""Bookkeeping of the paged KV cache: which fixed-size blocks each sequence holds, and which are cached.

Policy lives in the scheduler; this module only answers "can I?" (`can_allocate`, `can_append`)
and then commits (`allocate`, `may_append`, `deallocate`). A block is either free (ref count 0,
in `free_block_ids`) or referenced by the block tables of `ref_count` sequences.

Prefix caching: a full block whose K/V have been computed is registered under the chained hash
hash((hash of the previous block, its token ids)), so equal hashes mean equal whole prefixes.
Freed blocks keep their hash and stay reusable until they are evicted; the free list is kept in
LRU order (least recently freed first), so eviction takes the block unused for the longest time.
"""

from __future__ import annotations

from collections import OrderedDict

from engines.sequence import Sequence

ROOT_HASH = 0  # the "previous block" of a sequence's first block


class Block:
    __slots__ = ("block_hash", "block_id", "in_draft_cache", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full, computed and registered
        self.token_ids: tuple[int, ...] = ()
        # A speculative drafter's KV cache (same block layout) holds this block's K/V too: a sequence sharing it
        # from the prefix cache need not have the drafter compute it again.
        self.in_draft_cache = False

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


def chain_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: blocks are appended when freed and taken from the front.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of all of `seq`'s full blocks (memoised on the sequence)."""
        size = self.block_size
        hashes = seq.block_hashes
        for index in range(len(hashes), len(seq.token_ids) // size):
            prev = hashes[-1] if hashes else ROOT_HASH
            hashes.append(chain_hash(prev, tuple(seq.token_ids[index * size:(index + 1) * size])))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks holding the longest cached prefix of `seq`.

        At most `num_tokens - 1` tokens come from the cache: the last token is always computed so
        that the step produces logits for it; a request scoring its prompt takes none (every position's logits).
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        size = self.block_size
        hashes = self.block_hashes(seq)
        block_ids: list[int] = []
        for index in range((seq.num_tokens - 1) // size):
            block_id = self.hash_to_block_id.get(hashes[index])
            if block_id is None:
                break
            # The tokens are compared as well, so a hash collision can never serve wrong K/V.
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[index * size:(index + 1) * size]):
                break
            block_ids.append(block_id)
        return block_ids

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose K/V are now computed, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        # A speculative round advances the count before its tokens are appended: only known tokens are hashed.
        computed = min(seq.num_computed_tokens, seq.num_tokens)
        num_full = min(computed // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq)
        size = self.block_size
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            block_hash = hashes[index]
            if block.block_hash is None and block_hash not in self.hash_to_block_id:
                block.block_hash = block_hash
                block.token_ids = tuple(seq.token_ids[index * size:(index + 1) * size])
                self.hash_to_block_id[block_hash] = block.block_id
            # else: the same prefix is already cached in another block; this copy stays private.
        seq.num_registered_blocks = num_full

    def mark_drafted_blocks(self, seq: Sequence) -> None:
        """Note that a speculative drafter's cache now holds the K/V of `seq`'s full blocks up to its drafted
        count (only ever tokens the target accepted: a round's drafts count once verified)."""
        num_full = min(seq.num_draft_computed_tokens, seq.num_computed_tokens) // self.block_size
        for block_id in seq.block_table[:num_full]:
            self.blocks[block_id].in_draft_cache = True

    # -- allocation --------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, computed_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` (holding no blocks) can take `computed_blocks` plus room for `num_new_tokens`."""
        num_needed = self.num_blocks_for(len(computed_blocks) * self.block_size + num_new_tokens) - len(computed_blocks)
        # A cached block nobody references sits in the free list: reusing it takes it from there.
        num_revived = sum(1 for block_id in computed_blocks if self.blocks[block_id].ref_count == 0)
        return num_needed + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, computed_blocks: list[int], num_new_tokens: int) -> None:
        """Give `seq` the shared `computed_blocks` and fresh blocks for `num_new_tokens` more tokens."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(computed_blocks)
        seq.num_computed_tokens = len(computed_blocks) * self.block_size
        num_drafted = next((i for i, block_id in enumerate(computed_blocks)
                            if not self.blocks[block_id].in_draft_cache), len(computed_blocks))
        seq.num_draft_computed_tokens = num_drafted * self.block_size
        seq.num_registered_blocks = len(computed_blocks)
        self.may_append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can grow by `num_new_tokens` computed tokens."""
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return num_needed <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add the blocks `seq` needs for `num_new_tokens` more tokens (none if its last block has room)."""
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        # In ascending order: a freed sequence's blocks come back tail first, so blocks taken in eviction order
        # would lie backwards in memory, which the CPU's decode attention reads more slowly (`python -m
        # bench.kernels`' block-order table).
        seq.block_table.extend(sorted(self._take_free_block() for _ in range(num_needed)))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks past the first `num_tokens` tokens (rejected speculative tokens' slots).

        Only unregistered tail blocks can be dropped: registered ones are full of computed tokens."""
        keep = self.num_blocks_for(num_tokens)
        assert keep >= seq.num_registered_blocks, f"{seq.request_id}: cannot truncate registered blocks"
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                # It caches no prefix: hand it out before evicting a block that does.
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def deallocate(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Tail blocks are freed first so that they are evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.in_draft_cache = False
        block.ref_count = 1
        return block_id
