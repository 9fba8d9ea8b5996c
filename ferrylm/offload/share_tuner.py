"""The hybrid share tuned on measured step times: a hill climb over the host's share of the missed experts.

The calibration prices a share from one expert's costs timed at start-up, and those move between starts
(session 17, Mixtral 16L bf16 under 16 GiB on the H200 host: one start calibrated 0.20 and decoded 6.75 tok/s
where 0.45 decoded 8.98; session 16's starts gave 0.51 and 0.42). So the engine that chose its own share then
measures it: decode steps of one batch shape (the first seen) are timed from one step's start to the next,
the median of `SAMPLES` of them after `SETTLE` steps on each share (the first re-captures the graphs). Second it
times share 0 (hybrid off), which wins where it is faster by `MIN_GAIN`: the calibration's costs can favour a split
that loses (session 33, H200 host, the 8-layer NF4 Mixtral under 5 GiB at batch 1: `--experts auto` 13.2 ms a step,
`--experts gpu` 9.0; `profile_offload.py`), and timed second it shows within ~40 steps, not after the climb. From
the better of the two the share moves by `STEP` toward the faster neighbour while that is faster by `MIN_GAIN`,
then by `STEP / 2` once either side of the best. A plain function of the times
it is fed (`observe`); `PlacedWeights` feeds it and applies what it asks for between steps."""
from __future__ import annotations

import statistics

STEP = 0.1
"""First move of the share; the refinement moves half of it."""
SETTLE = 4
"""Steps discarded after each change (graph re-capture, the host worker's new windows)."""
SAMPLES = 16
"""Steps timed per share (their median)."""
MIN_GAIN = 0.02
"""A neighbour must be this much faster (its median period) to be taken."""


class ShareTuner:
    """Feed it one period per step at the share it last asked for (`share`); `observe` returns the next
    share to apply, or None to keep the current one. The climb: the start, then 0 (hybrid off), then one `step`
    above the better of the two, else one below; a side that won goes on by `step` while each share beats the
    last by `min_gain`; then half a step either side of the winner; a share within a quarter step of one timed is
    skipped (`_untried`). `done` once settled, at `best` (the share every later step runs)."""

    def __init__(self, share: float, step: float = STEP, settle: int = SETTLE, samples: int = SAMPLES,
                 min_gain: float = MIN_GAIN):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share {share} outside [0, 1]")
        self.step, self.settle, self.samples, self.min_gain = step, settle, samples, min_gain
        self.share = self.best = share
        self.measured: dict[float, float] = {}
        """Median period (s) of each share tried."""
        self.done = False
        self._seen: list[float] = []
        self._skip = settle
        self._phase = "start"  # start -> off -> up -> down -> climb -> refine
        self._direction = 0
        self._refine: list[float] = []

    def observe(self, period_s: float) -> float | None:
        if self.done:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._seen.append(period_s)
        if len(self._seen) < self.samples:
            return None
        self.measured[self.share] = statistics.median(self._seen)
        nxt = self._next()
        if nxt is None:
            self.done = True
            return self._go(self.best) if self.best != self.share else None
        return self._go(nxt)

    def _go(self, share: float) -> float:
        self.share, self._seen, self._skip = share, [], self.settle
        return share

    def _untried(self, share: float) -> float | None:
        """`share` (rounded) where it lies in [0, 1] and no share timed lies within a quarter step of it, else None.
        The start (any float) and 0 begin two lattices a step apart: a share of one next to one of the other is all
        but the same split to the engine (its columns are multiples of `HostExperts.split_unit`), or, next to 0, a
        hand-off with next to nothing for the host, and its time would share two decimals with the other's in
        `tuned_step_ms`. Hybrid off (0 itself) is never near a share: it skips the hand-off."""
        share = round(share, 4)
        if not 0.0 <= share <= 1.0 or share in self.measured:
            return None
        if share > 0 and any(abs(share - m) < self.step / 4 for m in self.measured):
            return None
        return share

    def _next(self) -> float | None:
        """The next share to time, given the one just timed (`self.share`); None: settled."""
        s, phase = self.share, self._phase
        won = phase != "start" and self.measured[s] < self.measured[self.best] * (1 - self.min_gain)
        if phase == "start" or won:
            self.best = s
        if phase == "start" and s > 0 and self._untried(0.0) is not None:
            self._phase = "off"  # hybrid off second: a split that loses shows within a short run
            return 0.0
        if phase in ("start", "off"):  # the climb from the better of the two
            b, phase = self.best, "up"
            nxt = self._untried(b + self.step)
            if nxt is None:
                phase, nxt = "down", self._untried(b - self.step)
        elif phase in ("up", "down") and won:
            self._direction, phase = (1 if phase == "up" else -1), "climb"
            nxt = self._untried(s + self._direction * self.step)
        elif phase == "up":
            phase, nxt = "down", self._untried(self.best - self.step)
        elif phase == "climb" and won:
            nxt = self._untried(s + self._direction * self.step)
        else:
            nxt = None
        if nxt is None and phase != "refine":
            phase = "refine"
            self._refine = [self.best + self.step / 2, self.best - self.step / 2]
        while nxt is None and self._refine:
            nxt = self._untried(self._refine.pop(0))
        self._phase = phase
        return nxt
