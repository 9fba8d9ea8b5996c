"""Pipeline stages: which layers a stage holds (`stage_layers`) and its KV cache seen by global layer
index (`StageKV`: a stage allocates blocks for its own layers only). It knows nothing about processes.
"""

from __future__ import annotations


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """Contiguous and as even as can be; the spare layers go to stages 1, 2, ... (stage 0's rank 0 also
    schedules, samples and detokenizes)."""
    if num_layers < stages:
        from ferrylm.errors import ConfigError

        raise ConfigError(f"{num_layers} layers cannot be split into {stages} pipeline stages")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if 0 < s <= extra else 0) for s in range(stages)]
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


class StageKV:
    """A KV cache over a stage's layers [first, first + n), addressed by global layer index."""

    def __init__(self, cache, first: int):
        self.cache, self.first = cache, first

    def layer(self, i: int):
        return self.cache.layer(i - self.first)

    def write(self, i: int, slots, k, v) -> None:
        self.cache.write(i - self.first, slots, k, v)

    def __getattr__(self, name):  # num_blocks, block_size, k, v, nbytes, ...
        return getattr(self.cache, name)
