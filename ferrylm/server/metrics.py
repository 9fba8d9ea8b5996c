"""Prometheus metrics for `GET /metrics`, named as vLLM names them with the `ferry:` prefix.

Owns: one `CollectorRegistry` per server (so several apps in one process never clash), the request-level
histograms and the finished-request counter (fed by `AsyncEngine` listener calls on the event loop thread),
a collector that turns the engine thread's published `EngineStats` into gauges and counters at scrape
time, `cache_config_info`, the process collectors (`process_*`, `python_gc_*`, `python_info`), and with
`compat="vllm"` a second copy of every `ferry:` series under vLLM's `vllm:` name, so dashboards built for
vLLM read the server unchanged. Does not know HTTP routes or the engine's internals. Every series has a
`model_name` label.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.llm_engine import RequestOutput
from ferrylm.sampling_params import SamplingParams

# vLLM's buckets, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "ferry:"
COMPAT_PREFIXES = {"vllm": "vllm:"}


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Gauges and counters read from the engine's latest `EngineStats` snapshot when scraped."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.labels = engine, [model_name]

    def describe(self):
        return []  # no collect() at registration: the engine may not exist yet

    def collect(self):
        s = self.engine.stats
        for name, doc, value in (
            ("ferry:num_requests_running", "Requests in the running batch.", s.num_running),
            ("ferry:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("ferry:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(self.labels, value)
            yield g
        for name, doc, value in (
            ("ferry:prompt_tokens", "Prompt tokens received.", s.prompt_tokens),
            ("ferry:generation_tokens", "Tokens generated.", s.generation_tokens),
            ("ferry:num_preemptions", "Sequences preempted (their KV dropped for recompute).", s.num_preemptions),
            ("ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(self.labels, value)
            yield c
        yield from self._offload(s.offload)
        from ferrylm.server import log_errors

        c = CounterMetricFamily("ferry:log_write_errors", "Log records that could not be written (a failing log "
                                "stream); serving goes on.", labels=["model_name"])
        c.add_metric(self.labels, log_errors.lost)
        yield c

    OFFLOAD = {
        "h2d_bytes": "Weight bytes copied host to device (streamed layers and expert misses).",
        "expert_hits": "Routed experts found on the device.",
        "expert_misses": "Routed experts not on the device (copied or computed on the host).",
        "cpu_experts": "Expert misses computed on the host's cores.",
        "weight_waits": "Layers that waited for a weight copy still in flight.",
        "weight_wait_s": "Seconds the device's compute stream sat waiting for weight copies still in flight.",
        "cpu_busy_s": "Seconds the host spent computing experts.",
        "cpu_wait_s": "Seconds steps waited for host expert results.",
        "copied_experts": "Expert misses copied into a device slot.",
        "mapped_experts": "Expert misses the device read in place from host memory.",
        "staged_experts": "Experts copied into a staging slot ahead of their layer's routing.",
        "staged_unused": "Staged experts their layer's step did not route to.",
        "steps": "Steps run by the offload engine.",
        "step_s": "Host seconds of the offload engine's steps (their launch on CUDA; the whole step on the CPU).",
        "device_step_s": "Seconds the device spent on the offload engine's steps (CUDA; 0 on the CPU engine).",
    }

    def _offload(self, stats: dict | None):
        """`ferry:offload_*` counters, only when weights live off the device; the per-token bytes and the
        hit rate are ratios of these with `generation_tokens`."""
        if stats is None:
            return
        for key, doc in self.OFFLOAD.items():
            c = CounterMetricFamily(f"ferry:offload_{key}", doc, labels=["model_name"])
            c.add_metric(self.labels, stats[key])
            yield c
        g = GaugeMetricFamily("ferry:offload_cpu_share", "Share of the last step's non-resident experts computed "
                              "on the host's cores.", labels=["model_name"])
        g.add_metric(self.labels, stats["cpu_share"])
        yield g
        busy = stats["device_step_s"] or stats["step_s"]  # `OffloadStats.busy_s`
        g = GaugeMetricFamily("ferry:offload_cpu_busy_share", "Host seconds computing experts per second of the "
                              "offload steps (cpu_busy_s over device_step_s, step_s on the CPU engine).",
                              labels=["model_name"])
        g.add_metric(self.labels, stats["cpu_busy_s"] / busy if busy > 0 else 0.0)
        yield g
        g = GaugeMetricFamily("ferry:offload_weight_wait_share", "Share of the offload steps' device time the device "
                              "sat waiting for weight copies (weight_wait_s over device_step_s).", labels=["model_name"])
        g.add_metric(self.labels, stats["weight_wait_s"] / busy if busy > 0 else 0.0)
        yield g


OLD_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}
"""Series vLLM's older dashboards read under another name (vLLM v0's): exposed under both in compat mode."""


class _Renamed:
    """Every `ferry:` family of `source` again under another prefix (and the old names of `OLD_NAMES`)."""

    def __init__(self, source: CollectorRegistry, prefix: str):
        self.source, self.prefix = source, prefix

    def describe(self):
        return []

    def collect(self):
        for fam in self.source.collect():
            if not fam.name.startswith(PREFIX):
                continue
            base = fam.name[len(PREFIX):]
            for name in (base, OLD_NAMES.get(base)):
                if name is None:
                    continue
                out = Metric(self.prefix + name, fam.documentation, fam.type, fam.unit)
                out.samples = [s._replace(name=self.prefix + name + s.name[len(fam.name):]) for s in fam.samples]
                yield out


class Metrics:
    """The server's registry; also the `AsyncEngine` listener that times requests."""

    def __init__(self, model_name: str, compat: str | None = None, max_model_len: int = 1 << 20):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, label = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.request_success = Counter("ferry:request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = hist("ferry:time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = hist("ferry:inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.tpot = hist("ferry:time_per_output_token_seconds", "Mean time per output token after the first, per "
                         "request.", ITL_BUCKETS)
        self.e2e = hist("ferry:e2e_request_latency_seconds", "Arrival to last output token.", REQUEST_BUCKETS)
        self.queue_time = hist("ferry:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.inference_time = hist("ferry:request_inference_time_seconds", "First scheduled to finished.",
                                   REQUEST_BUCKETS)
        self.prefill_time = hist("ferry:request_prefill_time_seconds", "First scheduled to first output token.",
                                 REQUEST_BUCKETS)
        self.decode_time = hist("ferry:request_decode_time_seconds", "First output token to finished.",
                                REQUEST_BUCKETS)
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = hist("ferry:request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.generation_tokens = hist("ferry:request_generation_tokens", "Generated tokens per finished request.",
                                      tokens)
        self.max_generation_tokens = hist("ferry:request_max_num_generation_tokens",
                                          "Most tokens one completion of a request generated.", tokens)
        self.params_n = hist("ferry:request_params_n", "The `n` of each request.", PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("ferry:request_params_max_tokens", "The `max_tokens` of each request.", tokens)
        self.iteration_tokens = hist("ferry:iteration_tokens_total", "Tokens computed per engine step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.cache_info = Gauge("ferry:cache_config_info", "The KV cache's configuration (value 1).",
                                ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
                                registry=r)
        for reason in ("stop", "length", "abort"):  # present from the start, at 0
            self.request_success.labels(model_name, reason)
        self.process = CollectorRegistry(auto_describe=False)
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.process)
        self.compat = None
        if compat is not None:
            if compat not in COMPAT_PREFIXES:
                raise ValueError(f"unknown metrics compat {compat!r} (one of {', '.join(COMPAT_PREFIXES)})")
            self.compat = CollectorRegistry(auto_describe=False)
            self.compat.register(_Renamed(self.registry, COMPAT_PREFIXES[compat]))
        self._live: dict[str, list] = {}
        """request id -> [arrival time, output tokens seen, time of the last one]."""

    def attach(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineCollector(engine, self.model_name))
        engine.listener = self

    def on_loaded(self, engine: AsyncEngine) -> None:
        core = engine.engine
        self.cache_info.labels(self.model_name, str(core.block_manager.block_size), str(core.block_manager.num_blocks),
                               str(core.block_manager.enable_prefix_caching).lower(),
                               str(core.runner.kv_cache.k.dtype).removeprefix("torch.")).set(1)

    def render(self) -> bytes:
        out = generate_latest(self.registry) + generate_latest(self.process)
        if self.compat is not None:
            out += generate_latest(self.compat)
        return out

    # -- AsyncEngine listener (event loop thread) ----------------------------------------------------

    def on_request(self, request_id: str, arrival_time: float, params: SamplingParams | None = None) -> None:
        self._live[request_id] = [arrival_time, 0, arrival_time]
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.params_max_tokens.observe(params.max_tokens)

    def on_step(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            arrival, seen, last = live
            total = sum(len(c.token_ids) for c in out.outputs)
            new = total - seen
            if new > 0:
                if seen == 0:
                    self.ttft.observe(now - arrival)
                    scheduled = out.metrics.get("first_scheduled_time")
                    self.queue_time.observe(max(0.0, (scheduled or now) - arrival))
                    new -= len(out.outputs)  # each completion's first token is not an inter-token gap
                for _ in range(max(new, 0)):
                    self.itl.observe(now - last)
                live[1], live[2] = total, now
            if out.finished:
                del self._live[out.request_id]
                self._finished(out, arrival, now)

    def _finished(self, out: RequestOutput, arrival: float, now: float) -> None:
        self.e2e.observe(now - arrival)
        self.request_success.labels(self.model_name, out.outputs[0].finish_reason or "stop").inc()
        m = out.metrics
        scheduled, first = m.get("first_scheduled_time"), m.get("first_token_time")
        end = m.get("finished_time") or now
        if scheduled is not None:
            self.inference_time.observe(max(0.0, end - scheduled))
            if first is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
        if first is not None:
            self.decode_time.observe(max(0.0, end - first))
        lens = [len(c.token_ids) for c in out.outputs]
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(lens))
        self.max_generation_tokens.observe(max(lens, default=0))
        if first is not None and max(lens, default=0) > 1:
            self.tpot.observe(max(0.0, end - first) / (max(lens) - 1))

    def on_abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.request_success.labels(self.model_name, "abort").inc()
