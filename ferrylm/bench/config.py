"""`BenchConfig`: every knob of a `ferry bench` run, one frozen dataclass, one docstring per field.

The CLI (`bench/cli.py`) maps its flags 1:1 onto these fields and takes its defaults from here; the levels
read only this object. A field a level does not use is ignored by it (soak has no sweep, latency no rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    """Server base URL, with or without a trailing /v1."""
    model: str | None = None
    """Model name sent in each request; None: the first id of GET /v1/models."""
    api: str = "completions"
    """`completions` (/v1/completions, prompt text) or `chat` (/v1/chat/completions, one user message)."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer KEY`; None: the OPENAI_API_KEY environment variable, if set."""

    prompt_tokens: tuple[int, int] = (512, 512)
    """Prompt length in tokens, drawn uniformly from [lo, hi] per prompt (synthetic prompts only)."""
    mix: tuple[tuple[str, float], ...] = (("en", 1.0),)
    """Synthetic prompt kinds (en, zh, code, math) with relative weights."""
    dataset: str | None = None
    """JSONL ({"prompt"} / {"messages"}, optional "max_tokens") or ShareGPT JSON; replaces synthetic prompts."""
    tokenizer: str | None = None
    """Local tokenizer (HF dir, tokenizer.json or .gguf) to fit prompt lengths when the server has no /tokenize."""
    num_prompts: int = 256
    """Distinct prompts built; requests cycle through them."""
    max_tokens: int = 256
    """Output tokens asked per request (a dataset row's own max_tokens wins)."""
    ignore_eos: bool = True
    """Ask the server to ignore EOS so each request makes max_tokens (vLLM / llama.cpp / ferrylm extension)."""
    temperature: float = 0.0
    seed: int = 0
    """Seeds prompt choice and the arrival schedule: the same seed sends the same load."""

    num_requests: int | None = None
    """Stop after sending this many requests (None: bounded by duration only)."""
    duration: float | None = None
    """Stop sending after this many seconds (None: bounded by num_requests only)."""
    rate: float = math.inf
    """Mean arrival rate in requests/s; inf sends as fast as the concurrency cap allows."""
    arrivals: str = "poisson"
    """Arrival process: poisson (exponential gaps), gamma (gaps with shape `burstiness`), constant."""
    burstiness: float = 1.0
    """Gamma shape of the gaps: < 1 is burstier than Poisson, 1 is Poisson, > 1 is more regular."""
    max_concurrency: int = 64
    """Requests in flight at most; an arrival beyond it waits (its wait shows as sent - scheduled)."""
    warmup: int = 1
    """Requests sent and discarded before measuring (first-call costs)."""
    request_timeout: float = 600.0
    """Seconds one request may take before it is recorded as a timeout."""
    drain_timeout: float = 60.0
    """Seconds in-flight requests may still run once sending has stopped; then they are cancelled."""

    slo: tuple[tuple[str, float], ...] = ()
    """Per-request latency bounds (ttft, itl, tpot, e2e in seconds); goodput counts requests meeting all."""
    slo_target: float = 0.9
    """Fraction of requests that must meet the SLO; below it the SLO is broken (a sweep stops there)."""
    sweep: tuple[float, ...] | None = None
    """Rates to run one after another (load); () means auto: rate, 2*rate, 4*rate, ... until the SLO breaks."""
    sweep_steps: int = 8
    """Most rates an auto sweep tries."""

    out: str | None = None
    """Results folder; None: bench-results/<level>-<UTC time>."""
    progress: bool = True
    """Live progress display on stderr."""

    sample_every: float = 60.0
    """Soak: seconds between samples of server memory, /metrics and /health."""
    window: float | None = None
    """Soak: seconds per window for error rate and P99; None: duration / 20, at least sample_every."""
    pid: int | None = None
    """Soak: server process id for RSS / GPU memory; None: the process listening on a local URL's port."""
    rss_leak_per_day: float = 0.3e9
    """Soak bar: RSS may grow at most this many bytes per 24 h (upper 95% bound of the fitted slope)."""
    gpu_leak_per_day: float = 120e6
    """Soak bar: GPU memory may grow at most this many bytes per 24 h."""
    max_5xx_rate: float = 0.0002
    """Soak bar: fraction of requests answered 5xx (or lost to a dropped connection)."""
    max_p99_drift: float = 0.05
    """Soak bar: the fitted change of the per-window P99 over the run, in seconds, either way."""
    drift_metric: str = "e2e"
    """Soak: which latency's P99 the drift bar reads (ttft, itl, e2e)."""
    chaos: tuple[str, ...] = ()
    """Soak: faults to inject one after another on this machine (cpu-load, net-delay, net-drop, disk-fill);
    bench/chaos.py."""
    chaos_delay: float = 0.2
    """Soak: seconds the net-delay proxy holds each chunk from the server while that fault is on."""
    chaos_drop: float = 0.5
    """Soak: the share of requests whose response the net-drop proxy cuts mid-stream while that fault is on."""
    chaos_dir: str | None = None
    """Soak: the folder disk-fill fills (the server's temp or log folder); required for disk-fill."""
    chaos_fill_size: float = 1e9
    """Soak: bytes disk-fill writes at most (less if the disk fills first)."""
    chaos_fill_files: int = 100_000
    """Soak: empty files disk-fill creates at most (fewer if the inodes run out first)."""

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


LEVEL_DEFAULTS = {
    "latency": {"num_requests": 20, "max_concurrency": 1},
    "load": {"duration": 60.0},
    "soak": {"duration": 3600.0, "rate": 1000 / 3600},
}
"""What each level changes from the field defaults above (the CLI shows these as its defaults)."""

API_KINDS = ("completions", "chat")
DRIFT_METRICS = ("ttft", "itl", "e2e")


def check(cfg: BenchConfig) -> BenchConfig:
    """`cfg` if every field can work, else a `BenchError` naming the first one that cannot."""
    from ferrylm.bench import BenchError
    from ferrylm.bench.arrivals import KINDS
    from ferrylm.bench.workload.corpus import KINDS as PROMPT_KINDS

    problems = [
        (cfg.api in API_KINDS, f"--api must be one of {', '.join(API_KINDS)}"),
        (cfg.arrivals in KINDS, f"--arrivals must be one of {', '.join(KINDS)}"),
        (cfg.drift_metric in DRIFT_METRICS, f"--drift-metric must be one of {', '.join(DRIFT_METRICS)}"),
        (all(k in PROMPT_KINDS for k, _ in cfg.mix), f"--mix kinds are {', '.join(PROMPT_KINDS)}"),
        (cfg.max_tokens >= 1, "--max-tokens must be >= 1"),
        (cfg.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (cfg.num_prompts >= 1, "--num-prompts must be >= 1"),
        (cfg.num_requests is None or cfg.num_requests >= 1, "-n/--num-requests must be >= 1"),
        (cfg.duration is None or cfg.duration > 0, "--duration must be > 0"),
        (cfg.num_requests is not None or cfg.duration is not None, "give -n/--num-requests or --duration"),
        (cfg.rate > 0, "--rate must be > 0"),
        (cfg.warmup >= 0, "--warmup must be >= 0"),
        (cfg.request_timeout > 0 and cfg.drain_timeout >= 0, "timeouts must be > 0"),
        (0 < cfg.slo_target <= 1, "--slo-target must be in (0, 1]"),
        (cfg.sample_every > 0, "--sample-every must be > 0"),
        (cfg.window is None or cfg.window > 0, "--window must be > 0"),
        (cfg.sweep_steps >= 1, "--sweep-steps must be >= 1"),
        (cfg.sweep is None or all(r > 0 for r in cfg.sweep), "--sweep rates must be > 0"),
        (not cfg.chaos or cfg.duration is not None, "--chaos needs a --duration to place its faults in"),
        (0 < cfg.chaos_drop <= 1, "--chaos-drop must be in (0, 1]: the share of requests net-drop cuts"),
        ("disk-fill" not in cfg.chaos or bool(cfg.chaos_dir), "--chaos disk-fill needs --chaos-dir (the server's "
                                                              "temp or log folder)"),
    ]
    for ok, message in problems:
        if not ok:
            raise BenchError(message)
    return cfg
