"""Prometheus metrics for `GET /metrics`, named as vLLM names them with the `ferry:` prefix.

Owns: one `CollectorRegistry` per server (so several apps in one process never clash), the request-level
histograms and the finished-request counter (fed by `AsyncEngine` listener calls on the event loop thread),
and a collector that turns the engine thread's published `EngineStats` into gauges and counters at scrape
time. Does not know HTTP routes or the engine's internals. Every series has a `model_name` label.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.llm_engine import RequestOutput

# vLLM's buckets, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


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


class Metrics:
    """The server's registry; also the `AsyncEngine` listener that times requests."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, label = self.registry, ["model_name"]
        self.request_success = Counter("ferry:request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("ferry:time_to_first_token_seconds", "Arrival to first output token.", label,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("ferry:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             label, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("ferry:e2e_request_latency_seconds", "Arrival to last output token.", label,
                             buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("ferry:request_queue_time_seconds", "Arrival to first scheduled.", label,
                                    buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        for reason in ("stop", "length", "abort"):  # present from the start, at 0
            self.request_success.labels(model_name, reason)
        self._live: dict[str, list] = {}
        """request id -> [arrival time, output tokens seen, time of the last one]."""

    def attach(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineCollector(engine, self.model_name))
        engine.listener = self

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- AsyncEngine listener (event loop thread) ----------------------------------------------------

    def on_request(self, request_id: str, arrival_time: float) -> None:
        self._live[request_id] = [arrival_time, 0, arrival_time]

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
                self.e2e.observe(now - arrival)
                self.request_success.labels(self.model_name, out.outputs[0].finish_reason or "stop").inc()

    def on_abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.request_success.labels(self.model_name, "abort").inc()
