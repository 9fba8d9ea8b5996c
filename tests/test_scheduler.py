"""Scheduler on the CPU with hand-built sequences and a fake model that writes a fake KV cache."""

import random

import pytest

from ferrylm.config import SchedulerConfig
from ferrylm.engine.scheduler import Scheduler, SchedulerOutput
from ferrylm.engine.sequence import Sequence, SequenceStatus
from ferrylm.errors import InvalidRequestError
from ferrylm.kv.block_manager import BlockManager
from ferrylm.kv.state_pool import StateSlotPool

BS = 4
_prompt_base = iter(range(1000, 10**9, 1000))


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, chunked=True, prefix=True,
                   state_slots=None, allow_prefix_with_state=False) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked)
    pool = StateSlotPool(state_slots) if state_slots is not None else None
    return Scheduler(cfg, BlockManager(num_blocks, BS, prefix), pool, allow_prefix_with_state)


def make_seq(prompt_len=None, tokens=None, request_id="") -> Sequence:
    """A sequence with a prompt of distinct tokens (no accidental prefix hits), or the given tokens."""
    if tokens is None:
        base = next(_prompt_base)
        tokens = list(range(base, base + prompt_len))
    return Sequence(prompt_token_ids=list(tokens), request_id=request_id)


def check_invariants(sched: Scheduler, out: SchedulerOutput | None = None) -> None:
    bm = sched.block_manager
    refs = [0] * bm.num_blocks
    for s in sched.running:
        assert s.status == SequenceStatus.RUNNING
        assert len(s.block_table) * BS >= s.num_computed_tokens
        for b in s.block_table:
            refs[b] += 1
    for s in sched.waiting:
        assert s.status == SequenceStatus.WAITING and s.block_table == [] and s.state_slot is None
    free = set(bm.free_block_ids)
    assert len(free) == bm.num_free_blocks
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.block_id in free) == (block.ref_count == 0)
    assert sum(r > 0 for r in refs) + len(free) == bm.num_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    keys = [(s.arrival_time, s.seq_id) for s in sched.running]
    assert keys == sorted(keys)
    if sched.state_pool is not None:
        slots = [s.state_slot for s in sched.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert sched.state_pool.num_free == sched.state_pool.num_slots - len(slots)
    if out is not None:
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len({id(s) for s in out.seqs}) == len(out.seqs)
        for s, n in zip(out.seqs, out.num_new_tokens):
            assert s in sched.running and 1 <= n <= s.num_uncomputed_tokens
            assert len(s.block_table) * BS >= s.num_computed_tokens + n
        prefill = [s.is_prefill for s in out.seqs]
        assert prefill == sorted(prefill), "decodes must come before prefill chunks"


def step(sched: Scheduler, next_token=lambda seq: 7) -> SchedulerOutput:
    """One engine step with a fake model: schedule, 'run', postprocess, append sampled tokens."""
    out = sched.schedule()
    check_invariants(sched, out)
    mask = [out.samples(i) for i in range(len(out.seqs))]
    sched.postprocess(out)
    for seq, sampled in zip(out.seqs, mask):
        if sampled:
            seq.append_token(next_token(seq))
    return out


def finish(sched, seq):
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)


def test_decodes_first_then_prefill_chunks():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seq(5), make_seq(6)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [5, 6]
    assert a.num_output_tokens == b.num_output_tokens == 1  # both sampled
    c = make_seq(40)
    sched.add(c)
    out = step(sched)
    assert out.seqs == [a, b, c] and out.num_new_tokens == [1, 1, 14]
    assert c.num_output_tokens == 0 and out.num_batched_tokens == 16


def test_chunked_prefill_splits_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=32)
    seq = make_seq(100)
    sched.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        out = step(sched)
        assert out.seqs == [seq]
        chunks.append((out.num_new_tokens[0], seq.num_output_tokens == 1))
    assert chunks == [(32, False), (32, False), (32, False), (4, True)]
    assert seq.num_computed_tokens == 100 and seq.num_tokens == 101
    out = step(sched)
    assert out.num_new_tokens == [1]


def test_chunked_prefill_disabled_waits_for_whole_prompt():
    sched = make_scheduler(max_num_batched_tokens=32, chunked=False)
    a, b = make_seq(20), make_seq(20)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.seqs == [a]  # b does not fit the rest of the budget and is not chunked
    out = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 20]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3)
    seqs = [make_seq(4) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert out.seqs == seqs[:3] and sched.num_running == 3 and sched.num_waiting == 2
    finish(sched, seqs[1])
    out = step(sched)
    assert out.seqs == [seqs[0], seqs[2], seqs[3]] and sched.num_waiting == 1


def test_fifo_stops_at_first_seq_that_does_not_fit():
    sched = make_scheduler(num_blocks=6)
    big, small = make_seq(17), make_seq(4)
    running = make_seq(8)
    sched.add(running)
    step(sched)  # running holds 2 blocks, 4 left
    sched.add(big)  # 5 blocks: must wait
    sched.add(small)  # would fit, but may not overtake big
    out = step(sched)
    assert out.seqs == [running] and sched.num_waiting == 2


def test_preemption_lifo_then_recompute():
    # 6 blocks of 4: three prompts of 7 tokens take 2 blocks each; the 9th token needs a third block.
    sched = make_scheduler(num_blocks=6)
    a, b, c = make_seq(7), make_seq(7), make_seq(7)
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # prefill all three
    out = step(sched)  # token 8 of each still fits
    assert out.seqs == [a, b, c] and out.preempted == []
    out = step(sched)  # token 9 of a needs a block: c (latest arrival) goes
    assert out.preempted == [c] and out.seqs == [a, b]
    assert list(sched.waiting) == [c] and c.status == SequenceStatus.WAITING
    assert c.num_computed_tokens == 0 and c.block_table == [] and c.num_preemptions == 1
    assert sched.num_preemptions == 1
    c_tokens = list(c.token_ids)
    assert c.num_output_tokens == 2
    finish(sched, a)
    out = step(sched)  # c comes back and recomputes prompt and outputs (its blocks went to a and b)
    assert out.seqs == [b, c] and out.num_new_tokens == [1, 9]
    assert c.num_output_tokens == 3 and c.token_ids[:9] == c_tokens
    finish(sched, b)
    while c.num_output_tokens < 6:
        step(sched)
    finish(sched, c)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 6


def test_preempts_itself_when_last():
    sched = make_scheduler(num_blocks=4)
    a, b = make_seq(5), make_seq(8)
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)  # a writes position 5 in its own block; b's position 8 needs a block and b is last
    assert out.seqs == [a] and out.preempted == [b]
    check_invariants(sched)
    assert step(sched).seqs == [a]  # b's two cached blocks + one fresh do not fit next to a
    finish(sched, a)
    out = step(sched)  # b's own full blocks are still cached: only its last token is recomputed
    assert out.seqs == [b] and out.num_new_tokens == [1] and b.num_cached_tokens == 8
    assert b.num_output_tokens == 2


def test_no_leaks_after_finish_and_abort():
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=16)
    r1 = [make_seq(tokens=range(10), request_id="r1") for _ in range(2)]  # n=2
    r2 = make_seq(30, request_id="r2")
    r3 = make_seq(6, request_id="r3")
    for s in (*r1, r2, r3):
        sched.add(s)
    out = step(sched)  # r1[0] prefills, r1[1] gets a 6-token chunk; r2 and r3 wait
    assert out.seqs == r1 and out.num_new_tokens == [10, 6] and sched.num_waiting == 2
    aborted = sched.abort("r1")
    assert set(map(id, aborted)) == set(map(id, r1))
    assert all(s.status == SequenceStatus.FINISHED_ABORTED and s.block_table == [] for s in r1)
    assert sched.abort("r3") == [r3] and sched.abort("nope") == []
    check_invariants(sched)
    while r2.num_output_tokens < 3:
        step(sched)
    finish(sched, r2)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 20


def test_prefix_cache_hit_for_shared_prompt():
    sched = make_scheduler()
    prompt = list(range(50, 60))  # 10 tokens: 2 full blocks + 2 tokens
    a = make_seq(tokens=prompt)
    sched.add(a)
    step(sched)
    b = make_seq(tokens=prompt)
    sched.add(b)
    out = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 2]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [sched.block_manager.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    assert b.num_output_tokens == 1
    # A prompt that ends on a block boundary still computes its last token.
    c = make_seq(tokens=prompt[:8])
    sched.add(c)
    out = step(sched)
    assert out.seqs[-1] is c and c.num_cached_tokens == 4 and out.num_new_tokens[-1] == 4
    for s in (a, b, c):
        finish(sched, s)
    assert sched.block_manager.num_free_blocks == 64
    assert sched.block_manager.prefix_hits == 12


def test_too_long_prompt_is_refused():
    sched = make_scheduler(num_blocks=4)
    sched.add(make_seq(15))  # 15 + 1 tokens = 4 blocks: fits
    with pytest.raises(InvalidRequestError, match="prompt of 16 tokens cannot fit in the KV cache"):
        sched.add(make_seq(16))
    assert sched.num_waiting == 1


def test_state_slots_follow_admission_finish_and_preemption():
    sched = make_scheduler(num_blocks=6, state_slots=4)
    pool = sched.state_pool
    a, b, c = make_seq(7), make_seq(7), make_seq(7)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert [s.state_slot for s in (a, b, c)] == [0, 1, 2] and pool.num_free == 1
    step(sched)
    out = step(sched)
    assert out.preempted == [c] and c.state_slot is None and pool.num_free == 2
    finish(sched, a)
    assert a.state_slot is None and pool.num_free == 3
    step(sched)
    assert c.state_slot is not None and pool.num_free == 2
    # With per-sequence state the prefix cache is not looked up: c recomputed from token 0.
    assert c.num_cached_tokens == 0


def test_state_slots_limit_admission():
    sched = make_scheduler(state_slots=1)
    a, b = make_seq(4), make_seq(4)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.seqs == [a] and sched.num_waiting == 1
    finish(sched, a)
    assert step(sched).seqs == [b] and b.state_slot == 0


def test_prefix_cache_with_state_when_allowed():
    prompt = list(range(9))
    for allowed, expect in ((False, 0), (True, 8)):
        sched = make_scheduler(state_slots=4, allow_prefix_with_state=allowed)
        a = make_seq(tokens=prompt)
        sched.add(a)
        step(sched)
        b = make_seq(tokens=prompt)
        sched.add(b)
        step(sched)
        assert b.num_cached_tokens == expect
        assert len(sched.block_manager.hash_to_block) >= 2  # hashes are registered either way


@pytest.mark.parametrize("seed,chunked,prefix,slots", [
    (0, True, True, None), (1, True, False, None), (2, False, True, None), (3, True, True, 12),
])
def test_random_engine_loop(seed, chunked, prefix, slots):
    """Many random requests through a fake model; the fake KV cache checks no block is ever aliased."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=40, max_num_seqs=12, max_num_batched_tokens=48, chunked=chunked,
                           prefix=prefix, state_slots=slots, allow_prefix_with_state=True)
    bm = sched.block_manager
    kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> the token prefix whose KV is stored there
    system_prompts = [[rng.randrange(100) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    max_tokens: dict[int, int] = {}
    num_requests, num_added = 60, 0
    all_seqs = []

    for step_no in range(3000):
        if num_added < num_requests and rng.random() < 0.3:
            prompt = rng.choice(system_prompts) + [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
            for _ in range(rng.choice([1, 1, 2])):  # n > 1: same prompt, same request id
                seq = make_seq(tokens=prompt, request_id=f"r{num_added}")
                max_tokens[seq.seq_id] = rng.randrange(1, 25)
                sched.add(seq)
                all_seqs.append(seq)
            num_added += 1
        if rng.random() < 0.02 and sched.has_unfinished():
            victim = rng.choice([*sched.waiting, *sched.running])
            sched.abort(victim.request_id)

        out = sched.schedule()
        check_invariants(sched, out)
        mask = [out.samples(i) for i in range(len(out.seqs))]
        for seq, n in zip(out.seqs, out.num_new_tokens):  # the fake model: read the context, write KV
            start = seq.num_computed_tokens
            for p in range(start):
                assert kv[seq.block_table[p // BS], p % BS] == tuple(seq.token_ids[: p + 1])
            for p in range(start, start + n):
                block = seq.block_table[p // BS]
                assert bm.blocks[block].ref_count == 1, "writing into a shared block"
                kv[block, p % BS] = tuple(seq.token_ids[: p + 1])
        sched.postprocess(out)
        for seq, sampled in zip(out.seqs, mask):
            if not sampled:
                continue
            seq.append_token(rng.randrange(100))
            if seq.num_output_tokens >= max_tokens[seq.seq_id] or seq.num_tokens >= sched.max_seq_len:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        check_invariants(sched)
        if num_added == num_requests and not sched.has_unfinished():
            break
    else:
        pytest.fail("requests did not drain: deadlock?")

    assert bm.num_free_blocks == bm.num_blocks
    assert all(s.is_finished for s in all_seqs)
    done = [s for s in all_seqs if s.status == SequenceStatus.FINISHED_LENGTH]
    assert all(s.num_output_tokens == max_tokens[s.seq_id] for s in done)
    assert sched.num_preemptions > 0
    if prefix:
        assert bm.prefix_hits > 0
    if slots is not None:
        assert sched.state_pool.num_free == slots


def test_sequence_outgrowing_the_pool_is_a_clear_error():
    sched = make_scheduler(num_blocks=2)
    seq = make_seq(3)
    sched.add(seq)
    while seq.num_tokens < sched.max_seq_len:  # the engine finishes here (FINISHED_LENGTH) ...
        step(sched)
    step(sched)  # ... if it does not, the last slot is used, then nothing more fits
    with pytest.raises(RuntimeError, match="more than the whole pool"):
        sched.schedule()
