"""TPGroup: the tensor-parallel group a sharded layer belongs to, and the two collectives it needs
(sum of partial outputs, gather of vocabulary shards).

A sharded layer captures the group current while it is built (`building(group)`, set by the model
runner around model construction), so two engines in one process (a TP engine and a single-process
reference, in tests) never see each other's group. Outside `building` the group is `SINGLE`: size 1,
every collective the identity, and the layers compute exactly what the plain ones do.
It knows nothing about processes, steps or models.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    backend: list = field(default_factory=list, compare=False)
    """[the TP ranks' torch.distributed backend] (ProcessGroupGloo / ProcessGroupNCCL; empty for size 1).
    A box: every layer holds this group, and closing the engine empties it, so the backend is destroyed
    then (its threads joined) and not at interpreter exit."""
    expert_parallel: bool = False
    """MoE banks shard whole experts across the group instead of each expert's intermediate dim."""

    @property
    def pg(self):
        if not self.backend:
            from ferrylm.errors import WorkerLostError

            raise WorkerLostError("the parallel engine is closed")
        return self.backend[0]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (in place), the row-parallel combine."""
        if self.size == 1:
            return x
        self.pg.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's [..., n] concatenated in rank order: [..., size * n] (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, intermediate features): n must divide evenly."""
        if n % self.size:
            from ferrylm.errors import ConfigError

            raise ConfigError(f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}")
        return n // self.size


SINGLE = TPGroup()

_building: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("ferry_tp_group", default=SINGLE)


def current_group() -> TPGroup:
    """The group layers built now belong to."""
    return _building.get()


@contextlib.contextmanager
def building(group: TPGroup):
    token = _building.set(group)
    try:
        yield group
    finally:
        _building.reset(token)
