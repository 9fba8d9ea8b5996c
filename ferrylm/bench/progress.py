"""`LiveView`: the live progress line on stderr (rich), fed from the session's running counters.

Shows the step, a bar over the run's bound (time or count, whichever is further along), requests sent,
done, failed and in flight, output tokens/s over the last seconds, and the median TTFT of recent requests.
Off when the config says so; on a non-terminal stderr rich prints only the final state.
"""

from __future__ import annotations

import time
from collections import deque

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class LiveView:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.sent = self.done = self.failed = self.inflight = 0
        self._tokens: deque = deque()  # (time, output tokens) of recent finishes
        self._ttft: deque = deque(maxlen=200)
        self._bar = None
        self._task = None
        self._bound: tuple[float, float | None, int | None] | None = None

    def start(self) -> None:
        if not self.enabled:
            return
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                             TimeElapsedColumn(), console=Console(stderr=True), refresh_per_second=2)
        self._bar.start()
        self._task = self._bar.add_task("starting", total=1.0, stats="")

    def step(self, description: str, duration: float | None, count: int | None) -> None:
        self._bound = (time.monotonic(), duration, count)
        self._step_done = self.done
        if self._bar is not None:
            self._bar.update(self._task, description=description, completed=0.0)

    def finished(self, output_tokens: int, ttft: float | None, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        self._tokens.append((now, output_tokens))
        if ttft is not None:
            self._ttft.append(ttft)
        self.refresh(now)

    def refresh(self, now: float | None = None) -> None:
        if self._bar is None or self._bound is None:
            return
        now = now or time.monotonic()
        while self._tokens and self._tokens[0][0] < now - 10:
            self._tokens.popleft()
        tok_s = sum(n for _, n in self._tokens) / 10
        start, duration, count = self._bound
        frac = max((now - start) / duration if duration else 0.0,
                   (self.done - self._step_done) / count if count else 0.0)
        ttft = sorted(self._ttft)[len(self._ttft) // 2] if self._ttft else None
        stats = (f"sent {self.sent}  done {self.done}  failed {self.failed}  in flight {self.inflight}  "
                 f"{tok_s:.0f} tok/s" + (f"  TTFT p50 {ttft * 1000:.0f} ms" if ttft is not None else ""))
        self._bar.update(self._task, completed=min(frac, 1.0), stats=stats)

    def stop(self) -> None:
        if self._bar is not None:
            self.refresh()
            self._bar.stop()
            self._bar = None
