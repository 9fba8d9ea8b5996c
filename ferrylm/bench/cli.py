"""`ferry bench latency|load|soak`: flags mapped 1:1 onto `BenchConfig` fields (defaults from there and
`LEVEL_DEFAULTS`), then the level runs in a `Session`. A Ctrl-C'd run writes its files and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from ferrylm.bench import BenchError
from ferrylm.bench import units
from ferrylm.bench.config import API_KINDS, DRIFT_METRICS, LEVEL_DEFAULTS, BenchConfig, check
from ferrylm.bench.workload.corpus import KINDS as PROMPT_KINDS

HELP = {
    "latency": "single-request latency: one request at a time (TTFT, ITL, E2E percentiles)",
    "load": "open-loop load: Poisson arrivals at --rate with a concurrency cap; --sweep rates until the SLO breaks",
    "soak": "long steady load watching server memory (leak slope), errors, /health and P99 drift",
}


def _typed(parse):
    """An argparse type from a units parser: its `BenchError` becomes argparse's one-line usage error."""
    def f(text):
        try:
            return parse(text)
        except BenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    f.__name__ = parse.__name__.replace("parse_", "")
    return f


def _show(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, tuple) and v and isinstance(v[0], tuple):
        return ",".join(f"{a}:{b:g}" if isinstance(b, float) else f"{a}={b}" for a, b in v)
    if isinstance(v, tuple):  # a token range
        return str(v[0]) if v[0] == v[1] else f"{v[0]}-{v[1]}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _faults(text: str) -> tuple[str, ...]:
    from ferrylm.bench.chaos import FAULTS

    faults = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in faults if f not in FAULTS]
    if bad or not faults:
        raise BenchError(f"unknown fault {bad[0] if bad else text!r}: choose from {', '.join(FAULTS)}")
    return faults


def _add_level(sub, level: str) -> None:
    p = sub.add_parser(level, help=HELP[level], description=HELP[level])
    d = BenchConfig(**LEVEL_DEFAULTS[level])

    g = p

    def flag(*names, field, help, **kw):
        """A flag for one `BenchConfig` field; absent from the namespace unless given (the field's default holds)."""
        default = getattr(d, field)
        if default not in (None, ()):
            help = f"{help} (default: {_show(default)})"
        g.add_argument(*names, dest=field, default=argparse.SUPPRESS, help=help, **kw)

    g = p.add_argument_group("server")
    flag("--url", field="url", help="server base URL, with or without /v1")
    flag("--model", field="model", help="model name to send (default: the first of GET /v1/models)")
    flag("--api", field="api", choices=API_KINDS, help="endpoint")
    flag("--api-key", field="api_key", help="bearer token (default: $OPENAI_API_KEY)")
    flag("--request-timeout", field="request_timeout", type=_typed(units.parse_duration), help="per request")

    g = p.add_argument_group("workload")
    flag("--prompt-tokens", field="prompt_tokens", type=_typed(units.parse_range), help="N or LO-HI tokens per prompt")
    flag("--mix", field="mix", type=_typed(lambda t: units.parse_mix(t, tuple(PROMPT_KINDS))),
         help=f"prompt kinds with weights, e.g. en,zh:2 (kinds: {', '.join(PROMPT_KINDS)})")
    flag("--dataset", field="dataset", help="JSONL ({prompt} / {messages}) or ShareGPT JSON instead of synthetic prompts")
    flag("--tokenizer", field="tokenizer", help="local tokenizer to fit prompt lengths (default: the server's /tokenize)")
    flag("--num-prompts", field="num_prompts", type=int, help="distinct prompts; requests cycle through them")
    flag("--max-tokens", field="max_tokens", type=int, help="output tokens per request")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", default=argparse.SUPPRESS,
                   help="let requests stop at EOS (default: ignore_eos, so each makes --max-tokens)")
    flag("--temperature", field="temperature", type=float, help="sampling temperature")
    flag("--seed", field="seed", type=int, help="seeds prompts and arrivals")

    g = p.add_argument_group("bounds")
    flag("-n", "--num-requests", field="num_requests", type=int, help="requests to send at most")
    flag("--duration", field="duration", type=_typed(units.parse_duration), help="stop sending after, e.g. 90s, 10m, 72h")
    if level != "latency":
        flag("--max-concurrency", field="max_concurrency", type=int, help="requests in flight at most")
    flag("--warmup", field="warmup", type=int, help="unmeasured requests first")
    flag("--drain-timeout", field="drain_timeout", type=_typed(units.parse_duration),
         help="how long in-flight requests may finish after sending stops")
    flag("--slo", field="slo", type=_typed(units.parse_slo), help="per-request bounds for goodput, e.g. ttft=2s,itl=100ms")
    flag("--slo-target", field="slo_target", type=float, help="fraction of requests that must meet the SLO")

    if level == "load":
        g = p.add_argument_group("arrivals")
        flag("--rate", field="rate", type=_typed(units.parse_rate), help="mean requests/s, or inf")
        flag("--arrivals", field="arrivals", choices=("poisson", "gamma", "constant"), help="arrival process")
        flag("--burstiness", field="burstiness", type=float, help="gamma shape (<1 bursty, 1 Poisson)")
        g.add_argument("--sweep", dest="sweep", nargs="?", const=(), default=argparse.SUPPRESS,
                       type=_typed(lambda t: tuple(units.parse_rate(x) for x in t.split(","))),
                       help="run several rates: a list (1,2,4) or, bare, double --rate until the SLO breaks")
        flag("--sweep-steps", field="sweep_steps", type=int, help="most rates a bare --sweep tries")
    if level == "soak":
        g = p.add_argument_group("soak")
        g.add_argument("--requests-per-hour", dest="rate", type=_typed(lambda t: units.parse_rate(t) / 3600),
                       default=argparse.SUPPRESS, help=f"mean arrival rate (default: {d.rate * 3600:g})")
        flag("--arrivals", field="arrivals", choices=("poisson", "gamma", "constant"), help="arrival process")
        flag("--sample-every", field="sample_every", type=_typed(units.parse_duration), help="server sampling interval")
        flag("--window", field="window", type=_typed(units.parse_duration),
             help="window for error rate and P99 (default: duration / 20, at least --sample-every)")
        flag("--pid", field="pid", type=int, help="server process for RSS / GPU memory (default: the local listener)")
        flag("--max-rss-growth", field="rss_leak_per_day", type=_typed(units.parse_size), help="bytes per 24 h")
        flag("--max-gpu-growth", field="gpu_leak_per_day", type=_typed(units.parse_size), help="bytes per 24 h")
        flag("--max-5xx-rate", field="max_5xx_rate", type=float, help="fraction of requests")
        flag("--max-p99-drift", field="max_p99_drift", type=_typed(units.parse_duration), help="either way")
        flag("--drift-metric", field="drift_metric", choices=DRIFT_METRICS, help="latency whose P99 is judged")
        flag("--chaos", field="chaos", type=_typed(_faults),
             help="inject faults on this machine, one after another: "
                  "cpu-load,net-delay,net-drop,disk-fill (docs/bench.md)")
        flag("--chaos-delay", field="chaos_delay", type=_typed(units.parse_duration),
             help="net-delay: hold each chunk from the server this long")
        flag("--chaos-drop", field="chaos_drop", type=float,
             help="net-drop: share of requests whose response is cut mid-stream (seeded by --seed)")
        flag("--chaos-dir", field="chaos_dir", help="disk-fill: the server's temp or log folder to fill")
        flag("--chaos-fill-size", field="chaos_fill_size", type=_typed(units.parse_size), help="disk-fill: bytes at most")
        flag("--chaos-fill-files", field="chaos_fill_files", type=int, help="disk-fill: empty files at most")

    g = p.add_argument_group("output")
    flag("--out", field="out", help="results folder (default: bench-results/LEVEL-UTCTIME)")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=argparse.SUPPRESS,
                   help="no live progress on stderr")
    p.set_defaults(func=cmd_bench, bench_level=level)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (latency, load, soak)",
                              description="Load-test any OpenAI-compatible server. Results: a folder with "
                                          "summary.json (also the last stdout line), records.jsonl and PNG plots.")
    levels = p.add_subparsers(dest="bench_level", required=True)
    for level in ("latency", "load", "soak"):
        _add_level(levels, level)
    return p


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    given = {k: v for k, v in vars(a).items() if k in names}
    if "num_requests" in given and "duration" not in given:  # -n alone bounds the run by count, not the level's time
        given["duration"] = None
    return check(dataclasses.replace(BenchConfig(**LEVEL_DEFAULTS[a.bench_level]), **given))


def cmd_bench(a: argparse.Namespace) -> None:
    from ferrylm.bench import latency, load, soak
    from ferrylm.bench.session import run

    cfg = config_from_args(a)
    level = {"latency": latency, "load": load, "soak": soak}[a.bench_level]
    summary = run(cfg, a.bench_level, level.needed(cfg), level.run)
    if summary["interrupted"]:
        raise SystemExit(130)
