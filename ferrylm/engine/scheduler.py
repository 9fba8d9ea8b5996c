"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption by recompute.

Owns: the waiting queue (FIFO) and the running list (arrival order), the per-step token budget, and who
gets preempted when KV blocks run out. Each `schedule()` returns one plain `SchedulerOutput`.
Does not know: tensors, the model, sampling, tokenization, or when a sequence should stop - the engine
appends sampled tokens and calls `finish()`.

The engine's step, in this order:
    out = scheduler.schedule()
    sample_mask = [out.samples(i) for i in range(len(out.seqs))]   # before anything advances
    run the model on out (start position of seq i = out.seqs[i].num_computed_tokens)
    scheduler.postprocess(out)                                      # advance num_computed_tokens
    append the sampled token to each seq with sample_mask[i]; scheduler.finish(seq, status) when done
A sequence may never grow past `scheduler.max_seq_len` tokens (the KV pool's capacity); the engine
finishes it with FINISHED_LENGTH there, as it does at max_model_len.
With async scheduling (`engine/llm_engine.py`) the sampled token is counted (`seq.num_pending`) before
its value is known, so a sequence is scheduled for its next decode one step before the engine knows
whether it stopped; the scheduler sees no difference.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ferrylm.config import SchedulerConfig
from ferrylm.engine.sequence import Sequence, SequenceStatus
from ferrylm.errors import InvalidRequestError
from ferrylm.kv.block_manager import BlockManager
from ferrylm.kv.state_pool import StateSlotPool


@dataclass
class SchedulerOutput:
    """One step's work: which sequences run, and how many new tokens each computes."""
    seqs: list[Sequence]            # batch order: decodes first, then prefill chunks
    num_new_tokens: list[int]       # per seq: tokens to compute this step (1 for a decode)
    preempted: list[Sequence] = field(default_factory=list)   # pushed back to waiting this step
    @property
    def num_batched_tokens(self) -> int: return sum(self.num_new_tokens)
    @property
    def is_empty(self) -> bool: return not self.seqs
    def samples(self, i: int) -> bool:
        """True when seq i's last uncomputed token is computed this step, so it yields logits to sample."""
        s = self.seqs[i]
        return s.num_computed_tokens + self.num_new_tokens[i] == s.num_tokens


def _arrival(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_manager: BlockManager,
        state_pool: StateSlotPool | None = None,
        prefix_caching_allowed_with_state: bool = False,
    ):
        self.config = scheduler_config
        self.block_manager = block_manager
        self.state_pool = state_pool
        # A prefix hit skips computing tokens, so per-sequence state (not stored in KV blocks) would be
        # missing; only look up the cache when the model has no such state or says it can restore it.
        self.use_prefix_cache = block_manager.enable_prefix_caching and (
            state_pool is None or prefix_caching_allowed_with_state
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order: the last one is preempted first
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence can hold: the whole KV pool."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        bm = self.block_manager
        needed = bm.num_blocks_for(seq.num_tokens + 1)
        if needed > bm.num_blocks:
            raise InvalidRequestError(
                f"prompt of {seq.num_tokens} tokens cannot fit in the KV cache: with one output token it "
                f"needs {needed} blocks of {bm.block_size} tokens, but the pool has only {bm.num_blocks}; "
                f"shorten the prompt or give the KV cache more memory",
                param="prompt",
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # ---- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first: a decode token, or the next chunk of an unfinished prefill.
        bm, bs = self.block_manager, self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = seq.num_uncomputed_tokens
            n = min(uncomputed, budget)
            if n <= 0 or seq.final_pending:  # its last token is on the way: nothing left to compute
                i += 1
                continue
            # most steps fit in the blocks the sequence holds: no call to the block manager then
            while (seq.num_computed_tokens + n + bs - 1) // bs > len(seq.block_table) \
                    and not bm.append_slots(seq, n):
                victim = self.running[-1]  # never one already scheduled: those sit before index i
                if victim is seq and i == 0:
                    raise RuntimeError(
                        f"sequence {seq.seq_id} needs {seq.num_computed_tokens + n} tokens of KV, more "
                        f"than the whole pool ({self.max_seq_len}); the engine must finish sequences at "
                        f"scheduler.max_seq_len"
                    )
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                (prefills if uncomputed > 1 else decodes).append((seq, n))  # seq.is_prefill
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: it was the last running one

        # 2. Waiting sequences, FIFO, unless this step had to preempt (no room to grow, so none to admit).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need logits at every prompt position, so such a prompt is computed in full
            cached = self.block_manager.find_cached_prefix(seq) \
                if self.use_prefix_cache and seq.sampling_params.prompt_logprobs is None else []
            uncomputed = seq.num_tokens - len(cached) * self.block_manager.block_size
            n = min(uncomputed, budget)
            # Without chunked prefill a prompt waits for a step with room for all of it; one longer than
            # any step's budget (a preempted sequence with its outputs) is chunked anyway, or it never runs.
            if n < uncomputed and not self.config.enable_chunked_prefill \
                    and uncomputed <= self.config.max_num_batched_tokens:
                break
            if self.state_pool is not None and self.state_pool.num_free == 0:
                break
            if not self.block_manager.allocate(seq, cached, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.state_pool is not None:
                seq.state_slot = self.state_pool.allocate()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, seq, key=_arrival)
            (prefills if seq.is_prefill else decodes).append((seq, n))
            budget -= n

        batch = decodes + prefills
        return SchedulerOutput(
            seqs=[s for s, _ in batch], num_new_tokens=[n for _, n in batch], preempted=preempted
        )

    def postprocess(self, output: SchedulerOutput) -> None:
        """After the model ran: the step's tokens now have KV; register blocks that became full."""
        bm = self.block_manager
        bs = bm.block_size if bm.enable_prefix_caching else 0
        for seq, n in zip(output.seqs, output.num_new_tokens):
            if seq.status != SequenceStatus.RUNNING:  # aborted while the step ran
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + n
            known = len(seq.token_ids)
            if bs and min(after, known) // bs > min(before, known) // bs:  # a block filled with known tokens
                bm.cache_full_blocks(seq)

    # ---- leaving the running set ----------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Drop all of the sequence's KV and put it at the front of the waiting queue to recompute."""
        self.running.remove(seq)
        self._release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The engine decided the sequence is done: free its blocks and state slot."""
        assert status.is_finished, status
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        seq.num_pending = 0  # tokens still on the device (async scheduling) are dropped with it
        self._release(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request, waiting or running, as aborted."""
        seqs = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.state_slot is not None and self.state_pool is not None:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = None
