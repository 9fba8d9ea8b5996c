"""`ferry serve` as clients and operators meet it, through real processes: schema-driven fuzzing, SIGTERM while
loading, and SIGTERM with requests that outlast --shutdown-timeout.

Fuzzing (schemathesis): requests come from the server's own /openapi.json (valid ones and, in negative mode,
ones that break the schema), seeded and bounded: FERRY_FUZZ_EXAMPLES per mode and operation (default small
for CI: 25, about 225 requests; the full sweep is FERRY_FUZZ_EXAMPLES=100, about 900). Token budgets in generated bodies
are clamped so a run stays short; every other value goes through as generated. Each response must be below
500, valid JSON (no NaN / Infinity) or an SSE stream that ends with [DONE]. The same server is then stopped
with requests in flight past its shutdown timeout: each gets an answer in the OpenAI envelope (streams an
error event and [DONE]), and the process exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from serving import Server, assert_envelope

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

API_KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "25"))  # ~225 requests in CI
BUDGET_FIELDS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 3, "best_of": 3}
SHUTDOWN_TIMEOUT = 1.0
GRACE = 5.0  # ferrylm.server.cli.SHUTDOWN_GRACE
LONG = {"prompt": "Story:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def srv():
    s = Server(["--api-key", API_KEY, "--max-model-len", "512", "--max-num-seqs", "8", "--max-queued-requests", "64",
                "--disable-access-log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)])
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(30)


def _assert_clean_exit(server: Server, rc: int) -> None:
    log = server.log_all()
    assert rc == 0, f"exit code {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log and "unexpected error" not in log, log[-5000:]


def _clamp(body):
    if isinstance(body, dict):
        for k, cap in BUDGET_FIELDS.items():
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                body[k] = cap


def _strict_json(text: str):
    def no_constant(name):
        raise ValueError(f"non-JSON constant {name}")
    return json.loads(text, parse_constant=no_constant)


def _check(case, r) -> None:
    where = f"{case.method} {case.formatted_path} body={str(getattr(case, 'body', None))[:500]!r}"
    assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:500]}"
    ctype = (r.headers.get("content-type") or [""])[0]  # schemathesis keeps every value of a header
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        for e in events[:-1]:
            _strict_json(e)
    elif ctype.startswith("application/json"):
        _strict_json(r.text)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_from_generated_requests(srv, mode):
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    seen = {"n": 0, "codes": {}}
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(mode))
        def run(case):
            _clamp(getattr(case, "body", None))
            r = case.call(base_url=srv.url, headers=HEADERS, timeout=60)
            seen["n"] += 1
            seen["codes"][r.status_code] = seen["codes"].get(r.status_code, 0) + 1
            _check(case, r)

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # an operation without inputs has no invalid request
    print(f"{mode.value}: {seen['n']} requests, status codes {dict(sorted(seen['codes'].items()))}")
    assert seen["n"] >= EXAMPLES


def test_sigterm_while_loading_exits_0():
    s = Server(["--max-model-len", "256"])
    try:
        seen = None
        deadline = time.monotonic() + 120
        while seen is None and time.monotonic() < deadline:
            assert s.proc.poll() is None, s.log_all()
            try:
                seen = httpx.get(s.url + "/health", timeout=1).json()["status"]
            except httpx.TransportError:
                time.sleep(0.01)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.stop(60)
        print(f"/health said {seen!r} at SIGTERM; exited {rc} after {time.monotonic() - t0:.1f} s")
        assert seen in ("loading", "ok")
        _assert_clean_exit(s, rc)
        assert time.monotonic() - t0 < 30
    finally:
        s.stop(10)


def test_sigterm_past_shutdown_timeout_ends_every_request_with_an_answer(srv):
    """Last in the module: it stops the fuzzed server."""
    s = srv
    try:
        events, plain = [], {}
        started = threading.Event()

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120,
                              headers=HEADERS) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        def non_stream():
            plain["r"] = httpx.post(s.url + "/v1/completions", json=LONG, timeout=120, headers=HEADERS)

        threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
        for t in threads:
            t.start()
        assert started.wait(60), s.log_all()
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        rc = s.stop(60)
        took = time.monotonic() - t0
        print(f"exit {rc} after {took:.1f} s (shutdown timeout {SHUTDOWN_TIMEOUT} s)")
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["code"] == "unavailable" and "shutting down" in last["error"]["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # the tokens that made it before the cut
        err = assert_envelope(plain["r"], 503)
        assert err["code"] == "unavailable"
        _assert_clean_exit(s, rc)
        assert SHUTDOWN_TIMEOUT * 0.9 < took < SHUTDOWN_TIMEOUT + GRACE, took
    finally:
        s.stop(10)
