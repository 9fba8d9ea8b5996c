"""Test helpers: capture the logits the engine samples from, per sequence, in step order."""

import contextlib


class _Recorder:
    """Stands in front of the engine's real sampler, records each row, then samples with it."""

    def __init__(self, inner, got: list):
        self._inner, self._got = inner, got

    def __call__(self, logits, seqs, *args):
        for row, s in zip(logits, seqs):
            self._got.append((s.seq_id, row.detach().clone()))
        return self._inner(logits, seqs, *args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def capture_logits(engine):
    """Yields a list that fills with (seq_id, logits row [V]) for every sampled row."""
    got: list = []
    real = engine.sampler
    engine.sampler = _Recorder(real, got)
    try:
        yield got
    finally:
        engine.sampler = real
