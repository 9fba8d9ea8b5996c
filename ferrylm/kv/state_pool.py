"""StateSlotPool: hands out rows of a per-sequence state buffer that is not KV (e.g. Yuan's filter state).

Only bookkeeping of integer slots 0 .. num_slots - 1; the tensors (`kv.cache.SequenceStatePool`, one
scratch row past those for the padded rows of CUDA-graph decode) live with the model runner. A slot is
handed on with its old contents: a model never reads them for a sequence that starts at token 0 (Yuan's
`LFBatch.cont`). The scheduler takes a slot when it admits a sequence and gives it back on finish, abort
or preemption.
"""

from __future__ import annotations

import heapq


class StateSlotPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first, keeping rows compact
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed but not in use")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
