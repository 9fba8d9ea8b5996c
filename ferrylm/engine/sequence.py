"""Sequence: the state of one generation stream (one of a request's `n` completions).

Pure bookkeeping: token ids, how many of them have KV in the cache, the block table, the life-cycle
status. No tensors, no tokenizer. The scheduler and block manager read and write it; the engine appends
sampled tokens.

With async scheduling a sampled token is counted before its value is known: `num_pending` tokens follow
`token_ids` whose values are still on the device (at most one when a step is scheduled: the last one).
`num_tokens` counts them (the scheduler's and block manager's view: KV positions); `token_ids`,
`output_token_ids` and `num_known_tokens` do not.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ferrylm.sampling_params import SamplingParams


_FINISH_REASONS = {2: "stop", 3: "length", 4: "abort"}


class SequenceStatus(enum.IntEnum):
    """Life-cycle; the order means something: everything >= FINISHED_STOPPED is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    """Hit EOS, a stop token id or a stop string."""
    FINISHED_LENGTH = 3
    """Hit max_tokens or the context length."""
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every generated token whose value is known."""
    num_pending: int = 0
    """Sampled tokens after `token_ids` whose values are still on the device (async scheduling)."""
    final_pending: bool = False
    """The pending token is the last one whatever its value (max_tokens or the length limit): the sequence
    finishes when it arrives, so the scheduler gives it no further step."""
    num_computed_tokens: int = 0
    """Leading tokens whose KV is in the cache (prefix-cache hits included)."""
    num_cached_tokens: int = 0
    """Of those, how many came from the prefix cache at the last admission."""
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    state_slot: int | None = None
    """Row of the per-sequence non-KV state pool (e.g. Yuan's filter state); None if the model has none."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it."""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    """Per generated token: {token_id: logprob} for the sampled token and the top-n."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def params(self) -> SamplingParams:
        """The sampler reads a sequence as one of its rows (`layers/sampler.py`)."""
        return self.sampling_params

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence holds, pending ones included (KV positions)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included (what the sampler counts: min_tokens, seeded steps)."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token still lacks KV (a fresh, chunked or recomputed prompt)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resolve_pending(self, token_id: int) -> None:
        """The first pending token's value arrived from the device."""
        assert self.num_pending > 0, f"seq {self.seq_id} has no pending token"
        self.num_pending -= 1
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; every token (output too) is prefilled again."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
