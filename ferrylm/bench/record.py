"""`Record`: what happened to one request, in times relative to the run's start (seconds).

Owns the derived latencies (TTFT, chunk gaps, TPOT, E2E), the ok / error classification and the JSONL form.
Does not know HTTP or how requests are scheduled.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class Record:
    index: int
    kind: str
    scheduled: float
    """When the arrival schedule wanted it sent."""
    step: int = 0
    """Sweep step (rate index) it belongs to; 0 outside a sweep."""
    sent: float | None = None
    first: float | None = None
    """First streamed chunk that carried text."""
    end: float | None = None
    chunk_times: array = field(default_factory=lambda: array("d"))
    """Arrival of every chunk that carried text (8 bytes each: a 72 h soak keeps them all in memory)."""
    prompt_tokens: int | None = None
    """From the server's usage; the fitted count when it sent none."""
    prompt_tokens_fitted: int | None = None
    """What the token counter said when the prompt was built."""
    output_tokens: int | None = None
    tokens_from: str | None = None
    """`usage` (the server's count) or `chunks` (chunks with text; the server sent no usage)."""
    finish_reason: str | None = None
    status: int | None = None
    """HTTP status; None when no response came (connection refused or lost)."""
    error: str | None = None
    cancelled: bool = False
    """Still in flight when the run stopped (Ctrl-C or the drain timeout)."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.status == 200 and self.first is not None

    @property
    def server_error(self) -> bool:
        """A 5xx, an error event inside a 200 stream, or a dropped connection: the server's fault, not ours."""
        if self.cancelled:
            return False
        return (self.status is None and self.error is not None) or (self.status or 0) >= 500 or (
            self.status == 200 and self.error is not None)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or not self.ok else self.end - self.sent

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.first) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        r = lambda x: None if x is None else round(x, 6)  # noqa: E731
        return {"index": self.index, "kind": self.kind, "step": self.step, "scheduled": r(self.scheduled),
                "sent": r(self.sent), "ttft": r(self.ttft), "e2e": r(self.e2e), "end": r(self.end),
                "prompt_tokens": self.prompt_tokens, "prompt_tokens_fitted": self.prompt_tokens_fitted,
                "output_tokens": self.output_tokens,
                "tokens_from": self.tokens_from, "chunks": len(self.chunk_times), "finish_reason": self.finish_reason,
                "status": self.status, "ok": self.ok, "error": self.error, "cancelled": self.cancelled,
                "chunk_times": [round(t - self.sent, 6) for t in self.chunk_times]}
