"""SamplingParams: what one request asks of the sampler and of the stop logic.

Validation lives here so the offline API, the CLI and the HTTP server refuse the same bad values with the
same words (each error names the parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ferrylm.errors import InvalidRequestError


MAX_N = 128
"""Completions per request: each is a sequence holding KV blocks, so a request cannot ask for millions."""
FLOAT32_MAX = 3.4028234663852886e38
"""Sampling floats become fp32 tensors: a larger value turns into inf and the logits into NaN."""
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
"""Outside it, dividing or multiplying fp32 logits overflows or flattens them to 0 (1e-300 rounds to 0)."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled by `ferrylm.structured` into a token mask."""

    kind: str
    """json (a JSON schema), json_object (any JSON object), regex, choice (one of several strings), grammar (Lark)."""
    spec: object = None
    """The schema (dict), the regex or Lark source (str), or the list of choices."""


@dataclass
class SamplingParams:
    n: int = 1
    """Independent completions of the same prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in prompt or output (CTRL-style divide/multiply)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Per-request seed: same seed, same output, whatever else is in the batch."""
    max_tokens: int | None = 16
    """None means up to the context length."""
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Top-n logprobs to return per generated token (0 = only the sampled token's)."""
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    """Top-n logprobs for each prompt token after the first (0 = only the prompt token's); computing them
    turns off the prefix cache for the request."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling (OpenAI's range: -100 to 100)."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (None: free text)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(param: str, why: str) -> None:
            raise InvalidRequestError(f"{param} {why}", param=param)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > FLOAT32_MAX:
                bad(name, f"must be a finite number, got {v!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            bad("repetition_penalty", f"must be in [{lo:g}, {hi:g}], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or t < 0:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            if not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r} for token {t}")
