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

    def scales(self, i: int):
        return self.cache.scales(i - self.first)

    def write(self, i: int, slots, k, v) -> None:
        self.cache.write(i - self.first, slots, k, v)

    def __getattr__(self, name):  # num_blocks, block_size, k, v, nbytes, ... (every per-layer method is above)
        return getattr(self.cache, name)


def split_step(step, parts: int) -> list[tuple[object, list[int]]]:
    """Cut a step (`StepInput`) into up to `parts` micro-batches of whole sequences, contiguous and about
    equal in tokens, so pipeline stages overlap: stage s runs micro-batch i while stage s+1 runs i-1.
    Returns (micro-batch, the indices in `step.sample_rows` its own sample rows stand for) each."""
    from ferrylm.engine.model_runner import StepInput

    qsl, B = step.query_start_loc, len(step.seq_lens)
    parts = max(1, min(parts, B))
    cuts, total = [0], qsl[-1]
    for k in range(1, parts):  # first sequence boundary at or past k/parts of the tokens
        cut = next(i for i in range(cuts[-1] + 1, B + 1) if qsl[i] * parts >= k * total or i == B - (parts - k))
        cuts.append(cut)
    cuts.append(B)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        t0, t1 = qsl[a], qsl[b]
        where = [j for j, r in enumerate(step.sample_rows) if t0 <= r < t1]
        out.append((StepInput(
            input_ids=step.input_ids[t0:t1], positions=step.positions[t0:t1], slots=step.slots[t0:t1],
            query_start_loc=[q - t0 for q in qsl[a:b + 1]], start_pos=step.start_pos[a:b],
            seq_lens=step.seq_lens[a:b], block_tables=step.block_tables[a:b],
            num_decodes=max(0, min(step.num_decodes, b) - a), state_slots=step.state_slots[a:b],
            sample_rows=[step.sample_rows[j] - t0 for j in where]), where))
    return out
