"""BlockManager on the CPU: allocation, reference counts, prefix-cache hits and eviction."""

import random

from ferrylm.engine.sequence import Sequence
from ferrylm.kv.block_manager import NO_HASH, BlockManager

BS = 4


def make_seq(tokens) -> Sequence:
    return Sequence(prompt_token_ids=list(tokens))


def check_invariants(bm: BlockManager, seqs) -> None:
    """Reference counts equal block-table references; a block is free exactly when nobody holds it."""
    refs = [0] * bm.num_blocks
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            refs[b] += 1
    free = set(bm.free_block_ids)
    assert len(free) == bm.num_free_blocks
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.block_id in free) == (block.ref_count == 0)
    assert sum(r > 0 for r in refs) + len(free) == bm.num_blocks
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h


def admit(bm: BlockManager, seq: Sequence, num_new_tokens: int | None = None) -> list[int]:
    """Look up the cache, allocate for the rest of the sequence (or a chunk), and return the hits."""
    cached = bm.find_cached_prefix(seq)
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - len(cached) * BS
    assert bm.allocate(seq, cached, num_new_tokens)
    return cached


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What a step does to the sequence: n more tokens get KV, full blocks get registered."""
    seq.num_computed_tokens += seq.num_uncomputed_tokens if n is None else n
    bm.cache_full_blocks(seq)


def test_allocate_append_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    assert admit(bm, seq) == []
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == 3 / 8
    compute(bm, seq)
    seq.append_token(99)
    for _ in range(3):  # tokens 10, 11, 12: the third one needs a 4th block
        assert bm.append_slots(seq, 1)
        compute(bm, seq, 1)
        seq.append_token(99)
    assert len(seq.block_table) == 4
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    check_invariants(bm, [])


def test_short_pool_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    big = make_seq(range(13))  # 4 blocks
    assert not bm.allocate(big, [], 13)
    assert big.block_table == [] and bm.num_free_blocks == 3
    seq = make_seq(range(12))
    admit(bm, seq)
    compute(bm, seq)
    seq.append_token(5)
    assert not bm.append_slots(seq, 1)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    check_invariants(bm, [seq])


def test_prefix_hit_shares_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)  # blocks 0 and 1 are full and registered; the third holds 2 tokens
    b = make_seq(list(range(10)) + [50, 51])
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert b.block_table[2] != a.block_table[2]
    assert bm.prefix_hits == 8 and bm.prefix_queries == 10 + 12
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 16


def test_never_hits_block_with_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(8))
    admit(bm, a)
    compute(bm, a)
    assert len(bm.hash_to_block) == 2
    b = make_seq(range(8))  # same prompt: both blocks are cached, but the last token must be computed
    admit(bm, b)
    assert b.num_cached_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_hit_needs_identical_prefix_not_just_identical_block():
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y, w = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    a = make_seq(x + y + [0])
    admit(bm, a)
    compute(bm, a)
    assert admit(bm, make_seq(w + y + [0])) == []  # y at the same position, different prefix
    assert admit(bm, make_seq(y + x + [0])) == []  # same blocks, other order
    assert admit(bm, make_seq(x + w + [0])) == a.block_table[:1]


def test_freed_cached_blocks_are_revived_then_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9))  # 2 full blocks + 1 partial
    admit(bm, a)
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    # The unhashed partial block goes out first; cached blocks are evicted tail first.
    assert list(bm.free_block_ids)[:1] == [a_blocks[2]]
    assert list(bm.free_block_ids)[-2:] == [a_blocks[1], a_blocks[0]]

    again = make_seq(range(9))
    assert admit(bm, again) == a_blocks[:2]  # revived out of the free list
    assert all(bm.blocks[b].ref_count == 1 for b in again.block_table)
    assert bm.num_free_blocks == 1
    check_invariants(bm, [again])
    bm.free(again)

    other = make_seq(range(100, 116))  # needs the whole pool: both cached blocks get evicted
    admit(bm, other)
    assert bm.hash_to_block == {}
    assert sorted(other.block_table) == [0, 1, 2, 3]
    compute(bm, other)
    bm.free(other)
    last = make_seq(range(9))
    assert admit(bm, last) == []  # a's prefix is really gone
    check_invariants(bm, [last])


def test_chunked_prefill_registers_only_computed_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(20))
    admit(bm, a, 6)
    assert len(a.block_table) == 2
    compute(bm, a, 6)  # block 0 full, block 1 half
    assert [bm.blocks[b].hash != NO_HASH for b in a.block_table] == [True, False]
    assert bm.append_slots(a, 6)
    compute(bm, a, 6)  # 12 computed: blocks 1 and 2 now full
    assert [bm.blocks[b].hash != NO_HASH for b in a.block_table] == [True, True, True]
    b = make_seq(range(20))
    assert admit(bm, b, 1) == a.block_table[:3]
    check_invariants(bm, [a, b])


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(10))
    admit(bm, a)
    compute(bm, a)
    assert bm.hash_to_block == {} and all(b.hash == NO_HASH for b in bm.blocks)
    assert admit(bm, make_seq(range(10))) == []
    assert bm.prefix_queries == 0


def test_random_alloc_free_never_hands_out_used_block():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=24, block_size=BS)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(400):
        if live and rng.random() < 0.4:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            seq = make_seq(rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(6))])
            cached = bm.find_cached_prefix(seq)
            held = {b for s in live for b in s.block_table}
            free_before = set(bm.free_block_ids)
            if bm.allocate(seq, cached, seq.num_tokens - len(cached) * BS):
                fresh = seq.block_table[len(cached):]
                assert set(fresh) <= free_before and not set(fresh) & held
                compute(bm, seq)
                live.append(seq)
        check_invariants(bm, live)
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_hits > 0


def test_a_huge_pool_costs_nothing_until_used():
    """A tiny model on a 141 GB GPU has tens of millions of blocks: no object per block at start-up (it took
    minutes), ids handed out fresh in ascending order, and the counts right throughout."""
    n = 50_000_000
    bm = BlockManager(num_blocks=n, block_size=BS)
    assert bm.blocks == [] and bm.num_free_blocks == n
    a, b = make_seq(range(9)), make_seq(range(100, 106))
    admit(bm, a)
    admit(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert len(bm.blocks) == 5 and bm.num_free_blocks == n - 5
    compute(bm, a)
    bm.free(a)  # its partial block is blank: handed out again first, before the fresh ids
    c = make_seq(range(200, 206))
    admit(bm, c)
    assert c.block_table == [2, 5] and bm.num_free_blocks == n - 4
