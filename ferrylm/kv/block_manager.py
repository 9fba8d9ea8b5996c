"""BlockManager: the paged KV cache's allocator - which block ids each sequence owns, and the prefix cache.

Owns: block reference counts, the free list (which doubles as the LRU of evictable cached blocks), and
the map from a full block's prefix hash to its block id. It writes `seq.block_table`,
`seq.num_computed_tokens` and `seq.num_cached_tokens` at admission.
Does not know: tensors or devices (a block id is a row index into the runner's cache tensors), scheduling
policy (token budgets, who gets preempted), or when a sequence finishes.

Prefix caching: once every token of a block has KV, the block is registered under
hash(previous block's hash, its token ids), so a hit means the whole prefix up to and including that
block is identical. A freed block keeps its hash and stays findable until the free list hands it out for
something else; blocks are handed out least recently freed first, and a sequence frees its blocks tail
first, so the shared roots of prefixes are evicted last.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Protocol

import xxhash


class Sequence(Protocol):
    """What the block manager reads and writes of a sequence (the engine's `Sequence` is one); kv/ does not
    import engine/."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_cached_tokens: int

    @property
    def num_tokens(self) -> int: ...

NO_HASH = -1


def hash_block(prev_hash: int, token_ids: list[int]) -> int:
    """Chain hash of a full block: depends on every token from the start of the sequence."""
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        """Chain hash once the block is full and computed; NO_HASH before."""
        self.token_ids: list[int] = []
        """The block's tokens once hashed; compared on a hit so a hash collision cannot alias."""

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = NO_HASH
        self.token_ids = []


class BlockManager:
    """Start-up is O(1) in the pool size: a block gets its `Block` the first time it is handed out (a tiny model
    on a 141 GB GPU has tens of millions of blocks; one object each took minutes). Free blocks wait in three
    places, handed out in this order: freed blocks without a hash (worthless once free; the latest first),
    never-used ids (ascending), freed blocks with a hash (the prefix cache, least recently freed first)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = []
        """The blocks handed out so far, by id (ids are handed out fresh in ascending order)."""
        self.hash_to_block: dict[int, int] = {}
        self._blank: list[int] = []
        """Freed blocks without a hash: a stack, the latest freed handed out first."""
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        """Freed blocks with a hash, least recently freed first: evictable, and found again by a prefix hit."""
        self.prefix_queries = 0
        """Tokens of admitted sequences looked up in the prefix cache (metrics)."""
        self.prefix_hits = 0
        """Of those, tokens found (metrics)."""

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, evictable cached blocks included."""
        return len(self._blank) + (self.num_blocks - len(self.blocks)) + len(self._cached_free)

    @property
    def free_block_ids(self) -> list[int]:
        """Every free block id in the order they will be handed out (for inspection: O(pool size))."""
        return self._blank[::-1] + list(range(len(self.blocks), self.num_blocks)) + list(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest run of leading full blocks already in the cache.

        The block holding the last token is never looked up: at least one token must be computed so the
        step yields logits to sample.
        """
        if not self.enable_prefix_caching:
            return []
        bs, hits, h = self.block_size, [], NO_HASH
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(h, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Admit a sequence: share `cached_blocks` (from `find_cached_prefix`) and add fresh blocks so that
        `num_new_tokens` more tokens fit. Sets num_computed/num_cached_tokens to the hit length.
        Returns False, changing nothing, when the pool is short."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_fresh = self.num_blocks_for(num_cached_tokens + num_new_tokens) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._cached_free[block_id]  # a found block has a hash
            block.ref_count += 1
        seq.block_table = list(cached_blocks) + [self._take_free_block() for _ in range(num_fresh)]
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached_tokens
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running sequence's block table so `num_computed_tokens + num_new_tokens` tokens fit.
        Returns False, changing nothing, when the pool is short."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hash of every block that became full of computed tokens whose values are known (call
        after a step, and again when pending tokens' values arrive: async scheduling computes a token's KV
        before the host knows the token)."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(table))
        first = num_full  # walk back to the first unhashed full block; earlier ones are all hashed
        while first > 0 and self.blocks[table[first - 1]].hash == NO_HASH:
            first -= 1
        for i in range(first, num_full):
            block = self.blocks[table[i]]
            prev_hash = self.blocks[table[i - 1]].hash if i > 0 else NO_HASH
            block.token_ids = seq.token_ids[i * bs:(i + 1) * bs]
            block.hash = hash_block(prev_hash, block.token_ids)
            self.hash_to_block[block.hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first; blocks reaching 0 join the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash == NO_HASH:  # worthless once free: hand it out before any cached block
                    self._blank.append(block_id)
                else:
                    self._cached_free[block_id] = None
        seq.block_table = []

    def _take_free_block(self) -> int:
        if self._blank:
            block_id = self._blank.pop()
        elif len(self.blocks) < self.num_blocks:
            block_id = len(self.blocks)
            self.blocks.append(Block(block_id))
        else:
            block_id, _ = self._cached_free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict: its old prefix is no longer findable
        block.reset()
        return block_id
