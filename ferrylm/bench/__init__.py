"""`ferry bench`: load testing of any OpenAI-compatible server in three levels.

- latency: one request at a time (TTFT, ITL, E2E percentiles);
- load: open-loop arrivals (Poisson, constant, gamma bursts) with a concurrency cap, an optional rate sweep
  until an SLO breaks, goodput;
- soak: a long load that samples the server's memory (RSS, GPU) and health, and judges leaks and P99 drift.

The package talks to the server only over HTTP (plus psutil / NVML for a local server process) and knows
nothing of ferrylm's engine: it must work the same against vLLM and llama.cpp.
"""

from ferrylm.errors import FerryError


class BenchError(FerryError):
    """A bench run that cannot start or go on: bad flags, unreachable server, unreadable dataset."""
