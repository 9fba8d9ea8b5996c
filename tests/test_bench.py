"""`ferry bench` end to end against a real `ferry serve` on 127.0.0.1 (embedded model), plus the arithmetic
on hand-built inputs, plus a test-only server (tests/bench_fake_server.py) for what the real one cannot be
made to do: leak memory, fail, die mid-run, speak llama.cpp's dialect.

Each run is a few seconds with tiny token budgets; most go through `ferrylm.cli.main` in this process (the
CLI's own code path, without paying a torch import per run); the Ctrl-C test goes through a real
`python -m ferrylm.cli` process.
"""

from __future__ import annotations

import json
import re
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

    def __init__(self, cmd: list[str], port: int, timeout: float = 180, log: str | None = None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(log, "w") if log else tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
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
        if self.log.name == "/dev/full":
            return "(its output went to /dev/full)"
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
        if self.log.name.startswith(tempfile.gettempdir()):
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


# -- against a real `ferry serve` ----------------------------------------------------------------------


def test_latency(ferry, tmp_path, capsys):
    """One request at a time, usage token counts, the files."""
    rc, summary, out = bench(capsys, "latency", "--url", ferry.url + "/v1", "--api-key", KEY, "-n", "3",
                             "--max-tokens", "6", "--prompt-tokens", "24", "--mix", "en,zh", "--out", str(tmp_path / "l"))
    assert rc == 0
    rows = check_consistent(summary, out, 6)
    assert summary["model"] == "SmolLM2-135M-Instruct" and summary["bench"] == "latency"
    assert summary["prompt_tokens_counted_by"].startswith("server POST /tokenize")
    assert len(rows) == 3 and all(r["ok"] and r["output_tokens"] == 6 and r["tokens_from"] == "usage" for r in rows)
    # fitted with the server's /tokenize, counted by its usage: the two agree
    print([(r["prompt_tokens_fitted"], r["prompt_tokens"]) for r in rows])
    assert all(r["prompt_tokens"] == r["prompt_tokens_fitted"] and abs(r["prompt_tokens"] - 24) <= 2 for r in rows)
    # one at a time: each request is sent after the previous one ended
    for a, b in zip(rows, rows[1:]):
        assert b["sent"] >= a["end"] - 1e-6
    assert summary["results"]["concurrency"]["max"] == 1
    assert set(summary["plots"]) == {"latency_cdf.png", "timeline.png"}


def test_load_chat_poisson(ferry, tmp_path, capsys):
    rc, s, out = bench(capsys, "load", "--url", ferry.url, "--api-key", KEY, "--api", "chat", "--rate", "3",
                       "--duration", "3s", "--max-tokens", "4", "--prompt-tokens", "16-64", "--mix", "en,zh,code,math",
                       "--max-concurrency", "4", "--slo", "ttft=60s,e2e=120s", "--seed", "7", "--warmup", "0",
                       "--out", str(tmp_path / "load"))
    assert rc == 0
    rows = check_consistent(s, out, 4)
    planned = schedule(3.0, "poisson", 3.0, None, seed=7)
    assert len(rows) == len(planned)  # the seeded schedule, every arrival sent
    first = min(r["scheduled"] for r in rows)
    assert sorted(r["scheduled"] - first for r in rows) == pytest.approx(planned, abs=1e-4)
    res = s["results"]
    # arrivals still waiting for one of the 4 slots when the 3 s ended are recorded, as not sent
    unsent = [r for r in rows if r["sent"] is None]
    assert all(r["cancelled"] and r["error"].startswith("not sent") for r in unsent)
    assert res["requests"]["ok"] + len(unsent) == len(rows) and res["concurrency"]["max"] <= 4
    assert all(r["output_tokens"] == 4 for r in rows if r["ok"])  # ignore_eos: every chat reply made max_tokens
    g = res["goodput"]
    assert g["good"] == res["requests"]["ok"] and g["met"] and g["fraction"] == 1.0
    assert res["output_tok_s"] == pytest.approx(res["output_tokens"] / res["duration_s"])


def test_soak_clean_server_passes(ferry, tmp_path, capsys):
    rc, s, out = bench(capsys, "soak", "--url", ferry.url, "--api-key", KEY, "--requests-per-hour", "7200",
                       "--duration", "4s", "--sample-every", "0.25s", "--window", "1s", "--max-tokens", "4",
                       "--prompt-tokens", "16", "--max-rss-growth", "50GB", "--max-p99-drift", "60s",
                       "--out", str(tmp_path / "soak"))
    assert rc == 0
    check_consistent(s, out, 4)
    soak = s["soak"]
    print(json.dumps(soak["memory"]["rss"]))
    assert s["pid"] == ferry.proc.pid  # found as the listener of the URL's port
    assert soak["checks"]["rss_leak"] == "pass" and soak["checks"]["health"] == "pass"
    assert soak["checks"]["server_errors"] == "pass" and soak["memory"]["rss"]["samples"] >= 5
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == soak["samples"] and all(x["health"] == 200 and x["rss"] > 0 for x in samples)
    assert all(x["kv_usage"] is not None for x in samples)  # read from ferry's /metrics
    windows = json.loads((out / "windows.json").read_text())
    assert sum(w["requests"] for w in windows) == s["results"]["requests"]["sent"] - s["results"]["requests"]["cancelled"]
    assert "soak.png" in s["plots"]


def test_ctrl_c_writes_what_it_has(ferry, tmp_path):
    out = tmp_path / "int"
    cmd = [sys.executable, "-m", "ferrylm.cli", "bench", "load", "--url", ferry.url, "--api-key", KEY, "--rate", "6",
           "--duration", "10m", "--max-tokens", "16", "--prompt-tokens", "16", "--warmup", "0", "--out", str(out)]
    # 6 requests a second of 16 tokens: several in flight when the first ends and the signal comes (64 tokens took
    # ~35 s to the first record on the 2-core CI box: the batch grows under the load before anything finishes)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    raw = out / "records.jsonl"
    while time.monotonic() < deadline and not (raw.exists() and raw.read_text().count("\n") >= 1):
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    s = json.loads(stdout.strip().splitlines()[-1])
    assert s["interrupted"] is True
    rows = check_consistent(s, out, 16)
    assert s["results"]["requests"]["ok"] >= 1 and s["results"]["requests"]["cancelled"] >= 1
    assert any(r["cancelled"] and not r["ok"] for r in rows)
    assert s["results"]["duration_s"] < 120  # it stopped, not ran out the 10 minutes


# -- a test-only server: leaks, failures, death, llama.cpp dialect ---------------------------------------


def test_soak_detects_injected_leak(tmp_path, capsys):
    srv = fake("--leak-mb-per-request", "3", "--itl", "0.002")
    try:
        rc, s, out = bench(capsys, "soak", "--url", srv.url, "--requests-per-hour", "36000", "--duration", "3s",
                           "--sample-every", "0.2s", "--window", "0.75s", "--max-tokens", "4", "--prompt-tokens", "16",
                           "--max-rss-growth", "50GB", "--max-p99-drift", "60s", "--out", str(tmp_path / "leak"))
    finally:
        srv.stop()
    assert rc == 0
    mem = s["soak"]["memory"]["rss"]
    print(json.dumps(mem))
    assert s["pid"] == srv.proc.pid
    assert s["soak"]["checks"]["rss_leak"] == "fail" and s["soak"]["verdict"] == "fail"
    # ~10 requests/s x 3 MB: about 30 MB/s, i.e. ~2.6 TB/day; the interval's low end is far over the 50 GB bar
    assert mem["slope_bytes_per_day"]["ci95"][0] > 50e9
    assert mem["last"] - mem["first"] > 20e6


def test_errors_and_a_dying_server_are_reported(tmp_path, capsys):
    srv = fake("--fail-every", "3", "--die-after", "8", "--itl", "0.005")
    try:
        rc, s, out = bench(capsys, "load", "--url", srv.url, "--rate", "10", "--duration", "2s", "--max-tokens", "8",
                           "--prompt-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "err"))
        assert srv.proc.wait(10) == 1  # it did die
    finally:
        srv.stop()
    assert rc == 0
    rows = check_consistent(s, out, 8)
    q = s["results"]["requests"]
    assert q["failed"] > 0 and q["ok"] > 0 and q["ok"] + q["failed"] == len(rows)
    assert "500" in q["failed_by_status"] and "no response" in q["failed_by_status"]
    assert any("injected failure" in e for e in q["first_errors"])
    assert q["server_errors"] == q["failed"]
    assert sorted(rows, key=lambda r: r["index"])[0]["ok"]  # the first request was fine


def test_llamacpp_dialect_chat_without_usage(tmp_path, capsys):
    srv = fake("--llamacpp", "--itl", "0.002")
    try:
        rc, s, out = bench(capsys, "latency", "--url", srv.url, "--api", "chat", "-n", "3", "--max-tokens", "5",
                           "--prompt-tokens", "30", "--out", str(tmp_path / "lcpp"))
    finally:
        srv.stop()
    assert rc == 0
    rows = check_consistent(s, out, 5)
    assert "llama.cpp" in s["prompt_tokens_counted_by"]
    assert s["results"]["tokens_counted_from"] == {"chunks": 3}
    # the role-only first chunk is not a token: 5 chunks with text, the first of them is the TTFT
    assert all(r["output_tokens"] == 5 and r["chunks"] == 5 for r in rows)


def test_sweep_stops_where_the_slo_breaks(tmp_path, capsys):
    srv = fake("--itl", "0.02")
    try:
        rc, s, out = bench(capsys, "load", "--url", srv.url, "--rate", "5", "--sweep", "--sweep-steps", "3",
                           "--duration", "0.6s", "--max-tokens", "3", "--prompt-tokens", "8", "--slo", "itl=1ms",
                           "--out", str(tmp_path / "sw1"))
        assert rc == 0 and len(s["steps"]) == 1 and s["slo_broke_at"] == 5 and s["max_rate_meeting_slo"] is None
        rc, s, out = bench(capsys, "load", "--url", srv.url, "--rate", "5", "--sweep", "--sweep-steps", "2",
                           "--duration", "0.6s", "--max-tokens", "3", "--prompt-tokens", "8", "--slo", "ttft=10s",
                           "--out", str(tmp_path / "sw2"))
    finally:
        srv.stop()
    assert rc == 0 and [x["rate"] for x in s["steps"]] == [5, 10] and s["max_rate_meeting_slo"] == 10
    assert "sweep.png" in s["plots"]
    rows = records(out)
    assert [sum(r["step"] == k for r in rows) for k in range(2)] == [x["requests"]["sent"] for x in s["steps"]]


def test_unreachable_server_and_bad_flags(capsys):
    rc = main(["bench", "latency", "--url", f"http://127.0.0.1:{_free_port()}", "-n", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach the server" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["bench", "load", "--slo", "speed=1s"])
    assert e.value.code == 2 and "METRIC" in capsys.readouterr().err
    rc = main(["bench", "load", "--rate", "inf", "--url", "http://127.0.0.1:1"])
    assert rc == 2 and "-n" in capsys.readouterr().err


def test_request_timeout_bounds_a_trickling_stream(tmp_path, capsys):
    srv = fake("--itl", "0.4")  # 8 tokens at 0.4 s each: each read is quick, the whole request is not
    try:
        rc, s, out = bench(capsys, "latency", "--url", srv.url, "-n", "2", "--max-tokens", "8", "--warmup", "0",
                           "--prompt-tokens", "8", "--request-timeout", "1s", "--out", str(tmp_path / "slow"))
    finally:
        srv.stop()
    assert rc == 0
    rows = records(out)
    assert [r["error"] for r in rows] == ["timeout after 1 s"] * 2
    assert all(0.9 < r["end"] - r["sent"] < 2.0 and r["chunks"] >= 1 for r in rows)
    assert s["results"]["requests"]["failed"] == 2 and s["results"]["ttft"]["n"] == 0


def test_flags_map_onto_the_config():
    from ferrylm.bench.cli import config_from_args
    from ferrylm.cli import build_parser

    cfg = lambda *argv: config_from_args(build_parser().parse_args(["bench", *argv]))  # noqa: E731
    load = cfg("load", "--rate", "2", "--prompt-tokens", "50-2000", "--mix", "en,zh:2", "--slo", "ttft=2s,itl=100ms")
    assert (load.rate, load.duration, load.num_requests, load.max_concurrency) == (2.0, 60.0, None, 64)
    assert load.prompt_tokens == (50, 2000) and load.mix == (("en", 1.0), ("zh", 2.0)) and load.sweep is None
    assert cfg("load", "-n", "16").duration is None  # -n alone: bounded by count, not the default minute
    assert cfg("load", "--sweep").sweep == () and cfg("load", "--sweep", "1,2,4").sweep == (1.0, 2.0, 4.0)
    soak = cfg("soak", "--requests-per-hour", "3600", "--max-rss-growth", "0.3GB", "--sample-every", "2m")
    assert soak.rate == pytest.approx(1.0) and soak.rss_leak_per_day == 0.3e9 and soak.sample_every == 120
    lat = cfg("latency", "--no-ignore-eos", "--api", "chat")
    assert (lat.num_requests, lat.max_concurrency, lat.ignore_eos, lat.api) == (20, 1, False, "chat")
    with pytest.raises(BenchError, match="--max-tokens"):
        cfg("latency", "--max-tokens", "0")


def test_soak_chaos_faults_are_reported_and_undone(tmp_path, capsys):
    import psutil

    srv = fake("--itl", "0.005")
    try:
        rc, s, out = bench(capsys, "soak", "--url", srv.url, "--requests-per-hour", "36000", "--duration", "4.5s",
                           "--sample-every", "0.5s", "--max-tokens", "4", "--prompt-tokens", "8",
                           "--chaos", "net-delay,cpu-load", "--chaos-delay", "0.25s", "--out", str(tmp_path / "chaos"))
    finally:
        srv.stop()
    assert rc == 0
    c = s["chaos"]
    print(json.dumps(c))
    delay, cpu = c["faults"]
    assert [f["fault"] for f in c["faults"]] == ["net-delay", "cpu-load"]
    assert c["baseline"]["requests"] >= 5 and delay["requests"] >= 2 and delay["error_rate"] == 0
    # each read from the server held 0.25 s by the proxy: over the baseline, and back to it once the fault is off
    assert delay["e2e_p50"] > 0.3 > c["baseline"]["e2e_p99"]
    assert delay["recovered_after_s"] is not None and delay["recovered_after_s"] < 1.5
    # baseline: the first third; then one 1.5 s slot per fault, on for its first half
    first = min(r["scheduled"] for r in records(out))
    assert delay["start"] - first == pytest.approx(1.5, abs=0.3) and cpu["start"] - delay["start"] == pytest.approx(1.5)
    assert delay["end"] - delay["start"] == pytest.approx(0.75)
    assert not [p for p in psutil.Process().children(recursive=True) if "while True" in " ".join(p.cmdline())]
    assert s["soak"]["checks"]["health"] == "pass"  # the monitor went around the proxy


def test_soak_disk_fill_is_bounded_and_removed(tmp_path, capsys):
    folder = tmp_path / "server-tmp"
    folder.mkdir()
    srv = fake("--itl", "0.002")
    try:
        rc, s, out = bench(capsys, "soak", "--url", srv.url, "--requests-per-hour", "18000", "--duration", "3s",
                           "--sample-every", "0.5s", "--max-tokens", "2", "--prompt-tokens", "8", "--chaos", "disk-fill",
                           "--chaos-dir", str(folder), "--chaos-fill-size", "5MB", "--chaos-fill-files", "300",
                           "--out", str(tmp_path / "fill"))
    finally:
        srv.stop()
    assert rc == 0
    (f,) = s["chaos"]["faults"]
    assert (f["fault"], f["bytes_written"], f["files_created"], f["disk_full"]) == ("disk-fill", 5_000_000, 300, False)
    assert f["left_behind"] is False and list(folder.iterdir()) == []
    with pytest.raises(BenchError, match="--chaos-dir"):
        from ferrylm.bench.cli import config_from_args
        from ferrylm.cli import build_parser

        config_from_args(build_parser().parse_args(["bench", "soak", "--chaos", "disk-fill"]))


def test_soak_net_drop_cuts_streams_and_recovers(ferry, tmp_path, capsys):
    rc, s, out = bench(capsys, "soak", "--url", ferry.url, "--api-key", KEY, "--requests-per-hour", "14400",
                       "--duration", "4.5s", "--sample-every", "0.5s", "--max-tokens", "6", "--prompt-tokens", "8",
                       "--chaos", "net-drop", "--chaos-drop", "0.6", "--seed", "3", "--out", str(tmp_path / "drop"))
    assert rc == 0
    c = s["chaos"]
    print(json.dumps(c))
    (drop,) = c["faults"]
    assert drop["fault"] == "net-drop" and drop["drop"] == 0.6 and drop["requests"] >= 3
    # some requests sent during the fault saw a broken stream, and every one of those was a cut
    assert drop["cuts"] >= 1 and drop["error_rate"] > 0
    assert drop["failed_by_cuts"] == round(drop["error_rate"] * drop["requests"])
    assert all(("Error" in e or "stream" in e) for e in drop["errors"]), drop["errors"]
    # nothing failed outside the fault, the server stayed healthy, and the injected failures were excused
    rows = records(out)
    assert all(r["ok"] for r in rows if not (drop["start"] <= r["sent"] <= drop["end"] + 0.5))
    assert drop["recovered_after_s"] is not None
    assert s["soak"]["server_errors"]["injected_excluded"] >= drop["failed_by_cuts"]
    assert s["soak"]["checks"]["server_errors"] == "pass" and s["soak"]["checks"]["health"] == "pass"
    # the server let go of the requests whose client vanished: nothing left running or holding KV blocks
    last = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
    assert (last["running"], last["waiting"], last["kv_usage"]) == (0, 0, 0), last
    from ferrylm.bench.cli import config_from_args
    from ferrylm.cli import build_parser

    with pytest.raises(BenchError, match="--chaos-drop"):
        config_from_args(build_parser().parse_args(["bench", "soak", "--chaos", "net-drop", "--chaos-drop", "0"]))


def test_disk_fill_on_a_real_small_file_system_runs_out_of_bytes_and_inodes(tmp_path):
    """On a 2 MB tmpfs with 64 inodes (needs mount rights: root in a container that allows it, else skipped):
    the byte phase stops at a full disk, the inode phase still runs and stops when the inodes run out."""
    from ferrylm.bench.chaos import DiskFill

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        fill = DiskFill(str(mnt), 50e6, 10_000)
        fill.do()
        assert fill.full and 1e6 <= fill.written < 2.2e6, fill.written
        assert fill.inodes_out and 30 < fill.created < 64, fill.created
        with pytest.raises(OSError):  # the fault is real: nothing else can create a file there now
            open(mnt / "server.log", "w").close()
        fill.undo()
        assert list(mnt.iterdir()) == []
        (mnt / "server.log").write_text("ok")  # and undone
    finally:
        subprocess.run(["umount", str(mnt)])


def test_serve_keeps_serving_when_its_log_cannot_be_written(tmp_path, capsys):
    """`ferry serve` has no log-file option: it logs to stderr. With stdout and stderr on /dev/full (every write
    fails with ENOSPC) and -v plus the access log (a line per request), it must still start, stay healthy and
    answer every request, and report the lost log lines on /health and /metrics."""
    port = _free_port()
    p = Proc([sys.executable, "-m", "ferrylm.cli", "-v", "serve", "--port", str(port), "--api-key", KEY,
              "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.05"], port, log="/dev/full")
    try:
        rc, s, out = bench(capsys, "latency", "--url", p.url, "--api-key", KEY, "-n", "4", "--max-tokens", "3",
                           "--prompt-tokens", "8", "--out", str(tmp_path / "full-log"))
        assert rc == 0 and s["results"]["requests"]["ok"] == 4, s.get("results")
        health = httpx.get(p.url + "/health", timeout=5)
        assert health.status_code == 200 and p.proc.poll() is None
        # the lost lines are counted and said where they can be read
        assert health.json()["log_write_errors"] > 0 and "could not be written" in health.json()["warning"]
        metrics = httpx.get(p.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
        assert re.search(r"^ferry:log_write_errors_total\{[^}]*\} [1-9]", metrics, re.M), metrics[-2000:]
    finally:
        p.stop()
