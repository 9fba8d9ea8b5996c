"""Schema-driven fuzzing of a real `ferry serve` with schemathesis: whatever a client sends, no 5xx.

Requests come from the server's own /openapi.json (valid ones and, in negative mode, ones that break the
schema), seeded and bounded: FERRY_FUZZ_EXAMPLES per mode and operation (default small for CI; the issue's
sweep is FERRY_FUZZ_EXAMPLES=100). Token budgets in generated bodies are clamped so a run stays short; every
other value goes through as generated. Each response must be below 500, valid JSON (no NaN / Infinity) or an
SSE stream that ends with [DONE].
"""

from __future__ import annotations

import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from serving import Server  # noqa: E402

API_KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "12"))
BUDGET_FIELDS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 3, "best_of": 3}


@pytest.fixture(scope="module")
def fuzz_server():
    s = Server(["--api-key", API_KEY, "--max-model-len", "128", "--max-num-seqs", "8", "--max-queued-requests", "64",
                "--disable-access-log", "--shutdown-timeout", "5"])
    try:
        s.wait_ready()
        yield s
    finally:
        rc = s.stop()
        log = s.log_all()
    assert rc == 0, log[-3000:]
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
def test_no_5xx_from_generated_requests(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    seen = {"n": 0, "codes": {}}
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(mode))
        def run(case):
            _clamp(getattr(case, "body", None))
            r = case.call(base_url=fuzz_server.url, headers=headers, timeout=60)
            seen["n"] += 1
            seen["codes"][r.status_code] = seen["codes"].get(r.status_code, 0) + 1
            _check(case, r)

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # an operation without inputs has no invalid request
    print(f"{mode.value}: {seen['n']} requests, status codes {dict(sorted(seen['codes'].items()))}")
    assert seen["n"] >= EXAMPLES
