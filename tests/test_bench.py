"""`ferry bench` end to end against a real `ferry serve` on 127.0.0.1 (embedded model), plus the arithmetic
on hand-built inputs, plus a test-only server (tests/bench_fake_server.py) for what the real one cannot be
made to do: leak memory, fail, die mid-run, speak llama.cpp's dialect.

Each run is a few seconds with tiny token budgets; most go through `ferrylm.cli.main` in this process (the
CLI's own code path, without paying a torch import per run); the Ctrl-C test and one plain run go through
a real `python -m ferrylm.cli` process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ferrylm.bench import BenchError, units
from ferrylm.bench.arrivals import schedule
from ferrylm.bench.monitor import parse_metrics
from ferrylm.bench.record import Record
from ferrylm.bench.report import summarize
from ferrylm.bench.stats import cdf, describe, fit_slope, percentile, verdict
from ferrylm.bench.workload.dataset import load_dataset
from ferrylm.bench.workload.prompts import synthetic_prompts
from ferrylm.bench.workload.tokens import LocalCounter, TokenCounter
from ferrylm.cli import main

KEY = "bench-key"
HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("FERRY_TEST_THREADS", "1")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process on 127.0.0.1, healthy before the test uses it, stopped after."""

    def __init__(self, cmd: list[str], port: int, timeout: float = 180):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=ENV)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not healthy after {timeout}s:\n{self.text()}")

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def ferry():
    port = _free_port()
    p = Proc([sys.executable, "-m", "ferrylm.cli", "serve", "--port", str(port), "--api-key", KEY,
              "--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory-gb", "0.1",
              "--disable-access-log"], port)
    yield p
    p.stop()


def fake(*flags) -> Proc:
    port = _free_port()
    return Proc([sys.executable, str(HERE / "bench_fake_server.py"), "--port", str(port), *flags], port, 60)


def bench(capsys, *argv) -> tuple[int, dict, Path]:
    """Run `ferry bench ...` in this process; (exit code, the last stdout line as JSON, results folder)."""
    capsys.readouterr()
    rc = main(["bench", *argv, "--no-progress"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1]) if out and out[-1].startswith("{") else {}
    return rc, summary, Path(summary.get("out", "."))


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]


def check_consistent(summary: dict, folder: Path, max_tokens: int) -> list[dict]:
    """What every run must satisfy: files, counts, ordered percentiles, per-record timing sense."""
    rows = records(folder)
    on_disk = json.loads((folder / "summary.json").read_text())
    assert on_disk == summary
    res = summary["results"] if "results" in summary else summary["steps"][-1]
    req = summary["results"]["requests"] if "results" in summary else None
    if req is not None:
        assert req["sent"] + (req["planned_or_sent"] - req["sent"]) == len(rows)
        assert req["ok"] + req["failed"] + req["cancelled"] == len(rows)
        assert req["ok"] == sum(r["ok"] for r in rows)
        assert res["e2e"]["n"] == res["ttft"]["n"] == req["ok"]
        assert res["output_tokens"] == sum(r["output_tokens"] for r in rows if r["ok"])
    for name in ("ttft", "itl", "e2e"):
        d = res[name]
        if d["n"]:
            assert d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"], d
    for r in rows:
        if r["ok"]:
            assert 0 < r["ttft"] <= r["e2e"]
            t = r["chunk_times"]
            assert t[0] == pytest.approx(r["ttft"], abs=1e-5) and t == sorted(t) and t[-1] <= r["e2e"] + 1e-5
            assert r["sent"] >= r["scheduled"] - 1e-6
    for png in summary["plots"]:
        data = (folder / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    return rows


# -- arithmetic on hand-built inputs --------------------------------------------------------------------


def test_units_read_and_refuse():
    assert units.parse_duration("100ms") == pytest.approx(0.1)
    assert units.parse_duration("72h") == 72 * 3600 and units.parse_duration("90") == 90
    assert units.parse_size("0.3GB") == 0.3e9 and units.parse_size("2GiB") == 2 * 2**30
    assert units.parse_range("50-2000") == (50, 2000) and units.parse_range("512") == (512, 512)
    assert units.parse_slo("ttft=2s,itl=100ms") == (("ttft", 2.0), ("itl", 0.1))
    assert units.parse_mix("en,zh:2", ("en", "zh")) == (("en", 1.0), ("zh", 2.0))
    for f, bad, words in ((units.parse_duration, "10 parsecs", "unit"), (units.parse_range, "9-3", "LO <= HI"),
                          (units.parse_slo, "speed=2s", "METRIC"), (units.parse_rate, "-1", "> 0")):
        with pytest.raises(BenchError, match=words):
            f(bad)
    with pytest.raises(BenchError, match="unknown prompt kind 'fr'"):
        units.parse_mix("en,fr", ("en", "zh"))


def test_percentiles_cdf_and_describe():
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([], 50) is None
    xs = np.random.default_rng(0).lognormal(0, 1, 1001)
    d = describe(list(xs))
    s = np.sort(xs)
    assert d["p50"] == pytest.approx(s[500]) and d["max"] == s[-1] and d["n"] == 1001
    assert d["p99"] == pytest.approx(s[990]) and d["p50"] <= d["p90"] <= d["p95"] <= d["p99"]
    x, y = cdf(xs)
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0) and y[-1] == 1.0 and y[0] == pytest.approx(1 / 1001)
    assert describe([None])["n"] == 0


def test_slope_interval_and_verdicts():
    rng = np.random.default_rng(1)
    t = np.arange(200.0)
    y = 5.0 + 0.5 * t + rng.normal(0, 2.0, t.size)
    s = fit_slope(t, y)
    b, a = np.polyfit(t, y, 1)
    print(f"slope {s.slope:.5f} (polyfit {b:.5f}), 95% CI [{s.low:.5f}, {s.high:.5f}]")
    assert s.slope == pytest.approx(b) and s.intercept == pytest.approx(a)
    assert s.low < 0.5 < s.high and s.high - s.low < 0.03
    assert verdict(s, bar=1.0) == "pass" and verdict(s, bar=0.1) == "fail"
    assert verdict(s, bar=0.5 - 1e-9 + (s.high - 0.5) / 2) == "inconclusive"
    flat = fit_slope(t, 5.0 + rng.normal(0, 2.0, t.size))
    assert verdict(flat, bar=0.1, scale=len(t), both_ways=True) in ("pass", "inconclusive")
    assert verdict(fit_slope(t, -0.5 * t), bar=1.0, scale=len(t), both_ways=True) == "fail"
    assert fit_slope([1, 2], [3, 4]) is None and verdict(None, 1.0) == "no data"


def test_arrivals_are_seeded_bounded_and_at_rate():
    a = schedule(2.0, "poisson", 1000.0, None, seed=3)
    assert a == schedule(2.0, "poisson", 1000.0, None, seed=3) and a != schedule(2.0, "poisson", 1000.0, None, seed=4)
    gaps = np.diff(a)
    print(f"poisson: {len(a)} arrivals in 1000 s at rate 2, mean gap {gaps.mean():.4f}")
    assert a[0] == 0 and max(a) < 1000 and gaps.mean() == pytest.approx(0.5, rel=0.06)
    assert np.std(gaps) / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: cv 1
    bursty = np.diff(schedule(2.0, "gamma", 1000.0, None, seed=3, burstiness=0.25))
    assert bursty.mean() == pytest.approx(0.5, rel=0.15) and np.std(bursty) / bursty.mean() > 1.5
    assert len(schedule(2.0, "poisson", 1000.0, 7, seed=0)) == 7
    assert schedule(4.0, "constant", 1.0, None, seed=0) == [0.0, 0.25, 0.5, 0.75]
    with pytest.raises(BenchError, match="-n"):
        schedule(float("inf"), "poisson", 10.0, None, seed=0)


def _rec(i, sent, first=None, gaps=(), tokens=None, status=200, error=None, cancelled=False):
    r = Record(i, "en", scheduled=sent, sent=sent, status=status, error=error, cancelled=cancelled)
    if first is not None:
        r.first = first
        r.chunk_times = list(np.cumsum([first, *gaps]))
        r.end = r.chunk_times[-1]
        r.output_tokens, r.tokens_from, r.prompt_tokens = tokens or len(r.chunk_times), "usage", 10
    else:
        r.end = sent + 0.01
    return r


def test_summary_of_hand_built_records():
    recs = [_rec(0, 0.0, 0.5, (0.1, 0.1)), _rec(1, 1.0, 1.2, (0.05,) * 4, tokens=9),
            _rec(2, 2.0, 4.0, (0.3,)),
            _rec(3, 2.5, status=500, error="HTTP 500: boom"), _rec(4, 3.0, status=None, error="ConnectError: refused"),
            _rec(5, 3.5, status=400, error="HTTP 400: too long"), _rec(6, 3.6, cancelled=True, status=None)]
    s = summarize(recs, slo=(("ttft", 1.0), ("itl", 0.2)), slo_target=0.5)
    q = s["requests"]
    assert (q["sent"], q["ok"], q["failed"], q["cancelled"], q["server_errors"]) == (7, 3, 3, 1, 2)
    assert q["failed_by_status"] == {"500": 1, "no response": 1, "400": 1}
    assert s["ttft"]["n"] == 3 and s["ttft"]["p50"] == pytest.approx(0.5)
    assert s["e2e"]["max"] == pytest.approx(2.3) and s["itl"]["n"] == 2 + 4 + 1
    assert s["output_tokens"] == 3 + 9 + 2 and s["tokens_counted_from"] == {"usage": 3}
    # tpot = (last chunk - first chunk) / (tokens - 1): 0.2 / 2, 0.2 / 8, 0.3 / 1
    assert sorted([recs[0].tpot, recs[1].tpot, recs[2].tpot]) == pytest.approx([0.025, 0.1, 0.3])
    assert s["tpot"]["p50"] == pytest.approx(0.1)
    # record 0 meets both (ttft .5, gaps .1); record 1 meets both; record 2 misses ttft (2.0); failures miss
    g = s["goodput"]
    assert (g["good"], g["judged"]) == (2, 6) and g["fraction"] == pytest.approx(2 / 6) and not g["met"]
    assert s["duration_s"] == pytest.approx(recs[2].end - 0.0)
    assert s["error_rate"] == pytest.approx(3 / 6)


def test_metrics_text_of_three_servers():
    text = ('# HELP x\nferry:num_requests_running{model_name="a b"} 3.0\nvllm:num_requests_waiting{model_name="m"} 2\n'
            'vllm:num_requests_waiting{model_name="n"} 1\nllamacpp:kv_cache_usage_ratio 0.25\n'
            'process_resident_memory_bytes 1.5e+09\n')
    m = parse_metrics(text)
    assert m == {"ferry:num_requests_running": 3.0, "vllm:num_requests_waiting": 3.0,
                 "llamacpp:kv_cache_usage_ratio": 0.25, "process_resident_memory_bytes": 1.5e9}


def test_synthetic_prompts_hit_their_lengths():
    from ferrylm.default_model import default_model_path

    for counter in (TokenCounter(), LocalCounter(default_model_path())):
        ps = synthetic_prompts(12, (40, 600), (("en", 1), ("zh", 1), ("code", 1), ("math", 1)), counter, seed=5)
        assert {p.kind for p in ps} == {"en", "zh", "code", "math"}
        for p in ps:
            assert p.tokens == counter.count(p.text)
            assert 40 - 3 <= p.tokens <= 600 + 3, (counter.name, p.kind, p.tokens)
        again = synthetic_prompts(12, (40, 600), (("en", 1), ("zh", 1), ("code", 1), ("math", 1)), counter, seed=5)
        assert [p.text for p in again] == [p.text for p in ps]
        exact = synthetic_prompts(8, (300, 300), (("en", 1), ("zh", 1)), counter, seed=2)
        print(counter.name, [p.tokens for p in exact])
        assert all(abs(p.tokens - 300) <= 2 for p in exact)


def test_dataset_files(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
                  '{"other": 1}\n')
    ps = load_dataset(str(jl), 10, TokenCounter(), seed=0)
    assert sorted(p.text for p in ps) == ["hello there", "hi"]
    assert {p.text: p.max_tokens for p in ps} == {"hello there": 5, "hi": None}
    sg = tmp_path / "s.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "why?"},
                                                 {"from": "gpt", "value": "because " * 10}]}]))
    (p,) = load_dataset(str(sg), 10, TokenCounter(), seed=0)
    assert p.text == "why?" and p.max_tokens == TokenCounter().count("because " * 10)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x"}\n{nope\n')
    with pytest.raises(BenchError, match=r"b.jsonl:2: not valid JSON"):
        load_dataset(str(bad), 10, TokenCounter(), seed=0)
