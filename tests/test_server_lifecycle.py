"""`ferry serve` start and stop through real processes: SIGTERM while loading, and SIGTERM with requests that
outlast --shutdown-timeout (each gets an answer in the OpenAI envelope: streams an error event and [DONE]).

Each test starts its own server (the embedded model, 127.0.0.1), since each ends with it stopped.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from serving import Server, assert_envelope

SHUTDOWN_TIMEOUT = 1.0
GRACE = 5.0  # ferrylm.server.cli.SHUTDOWN_GRACE
LONG = {"prompt": "Story:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _assert_clean_exit(server: Server, rc: int) -> None:
    log = server.log_all()
    assert rc == 0, f"exit code {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]


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


def test_sigterm_past_shutdown_timeout_ends_every_request_with_an_answer():
    s = Server(["--max-model-len", "512", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)])
    try:
        s.wait_ready()
        events, plain = [], {}
        started = threading.Event()

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        def non_stream():
            plain["r"] = httpx.post(s.url + "/v1/completions", json=LONG, timeout=120)

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
