"""A real `ferry serve` process for tests (127.0.0.1, a free port, the embedded model unless told otherwise),
and the small readers the server tests share: Prometheus samples and the OpenAI error envelope."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command() -> list[str]:
    """`ferry serve` once ferrylm.cli registers it; the server module's own entry point until then."""
    from ferrylm.cli import build_parser

    subs = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    if subs and "serve" in subs[0].choices:
        return [sys.executable, "-m", "ferrylm.cli", "serve"]
    return [sys.executable, "-m", "ferrylm.server.cli"]


class Server:
    def __init__(self, args: list[str], env: dict | None = None):
        """Starts `ferry serve --port P *args` at once; `wait_ready()` waits for /health."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ferry-serve-", suffix=".log", delete=False)
        cmd = _serve_command() + ["--port", str(self.port), *args]
        # one torch thread: on two cores shared with other jobs, two OpenMP threads wait on each other at every
        # barrier and a step runs ~20x slower (the server's answers do not depend on it)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("FERRY_TEST_THREADS", "1"), **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def log_all(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int:
        if self.returncode is None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.returncode = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.returncode = self.proc.wait()
        return self.returncode


def metric(text: str, name: str, **labels) -> float:
    """Value of one sample in Prometheus text (labels must match those given)."""
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(name)


def wait_idle(http, timeout: float = 60.0) -> str:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        if (metric(text, "ferry:kv_cache_usage_perc") == 0 and metric(text, "ferry:num_requests_running") == 0
                and metric(text, "ferry:num_requests_waiting") == 0):
            return text
        assert time.monotonic() < deadline, f"engine not idle:\n{text}"
        time.sleep(0.1)


def assert_envelope(r: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    """The OpenAI error envelope with `status` (and `param`, if given); returns the error object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


