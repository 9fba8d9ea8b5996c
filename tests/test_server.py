"""End to end through a real `ferry serve` process on 127.0.0.1 (embedded default model, API key set).

One server for the whole session (loading is the slow part); the official `openai` client drives chat,
completions and streaming (sync and async), httpx every error case. Greedy outputs are compared with
the offline `LLM` in this process. Token budgets stay small: the file should run in well under two
minutes on two busy cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from ferrylm import LLM, SamplingParams  # noqa: E402

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 512
MAX_SEQS = 32
MAX_QUEUED = 8
MAX_BODY = 1 << 20


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
    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ferry-serve-", suffix=".log", delete=False)
        cmd = _serve_command() + [
            "--port", str(self.port), "--api-key", API_KEY, "--max-model-len", str(MAX_LEN),
            "--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED),
            "--max-request-bytes", str(MAX_BODY), "--shutdown-timeout", "30", "--disable-access-log"]
        # one torch thread: on two cores shared with other jobs, two OpenMP threads wait on each other at every
        # barrier and a step runs ~20x slower (the server's answers do not depend on it)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("FERRY_TEST_THREADS", "1")}
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


@pytest.fixture(scope="session")
def server():
    s = Server()
    try:
        s.wait_ready()
        yield s
    finally:
        rc = s.stop()
        log = s.log_text()
        os.unlink(s.log.name)
    assert rc == 0, f"server exit code {rc} after SIGTERM:\n{log}"
    assert "Traceback" not in log, log


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The offline reference runs in this process: one thread here too (see Server), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("FERRY_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llm():
    return LLM(max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


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
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


# -- open endpoints and auth --------------------------------------------------------------------------

def test_health_version_metrics_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and "ferry:kv_cache_usage_perc" in r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "hi"})
        err = assert_envelope(r, 401)
        assert err["code"] == "invalid_api_key"


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    m = models[0].model_dump()
    assert m["object"] == "model" and m["owned_by"] == "ferrylm" and m["max_model_len"] == MAX_LEN
    assert m["root"].endswith(".gguf")
    assert client.models.retrieve(MODEL).id == MODEL


# -- generation ---------------------------------------------------------------------------------------

def test_completions_match_offline(client, llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    offline = llm.generate(prompts, greedy(6))
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in offline]
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
    assert r.object == "text_completion" and r.model == MODEL


CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_offline(llm):
    return llm.chat(CHAT_MESSAGES, greedy(5))[0].outputs[0]


def test_chat_matches_offline(client, chat_offline):
    r = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == chat_offline.text
    assert r.choices[0].finish_reason == chat_offline.finish_reason
    assert r.usage.completion_tokens == len(chat_offline.token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream_sync(client, chat_offline):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    first = with_choices[0].choices[0]
    # the first chunk already carries the first token: no role-only chunk ahead of it
    assert first.delta.role == "assistant" and first.delta.content
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == chat_offline.text
    assert with_choices[-1].choices[0].finish_reason == chat_offline.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(chat_offline.token_ids)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completion_stream_async(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as ac:
            kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
            full = (await ac.completions.create(**kw)).choices[0].text
            texts, reasons = [], []
            async for chunk in await ac.completions.create(**kw, stream=True):
                texts.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            return full, texts, reasons

    full, texts, reasons = asyncio.run(run())
    assert texts[0] and "".join(texts) == full
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_prompt_forms_n_and_echo(client, llm):
    ids = llm.tokenizer.encode("The capital of France is")
    want = llm.generate([ids], greedy(3))[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert r.choices[0].text == want
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [llm.tokenizer.decode(ids, skip_special_tokens=False) + want] * 2
    kw = dict(model=MODEL, prompt="Tell me a story", max_tokens=3, temperature=1.0, n=2, seed=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(tlp, abs=1e-5)  # greedy: top-1
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)
               for c in content)


def test_stop_strings_params_and_unknown_fields(http):
    base = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 6, "temperature": 0}
    full = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = full.strip()[2:4]  # a couple of characters inside the output
    cut = full[:full.index(stop)]
    body = {**base, "stop": [stop], "some_unknown_field": {"x": 1}, "user": "u", "logit_bias": {}}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    assert c["text"] == cut and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    # streamed text never shows the start of a stop string that is later cut
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == cut
    # every sampling field is accepted together
    extra = {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
             "repetition_penalty": 1.1, "stop_token_ids": [2], "ignore_eos": True, "max_tokens": 2, "temperature": 0.7}
    r = http.post("/v1/completions", json={**base, **extra})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_completion_tokens": 2, "temperature": 0, "tools": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_tokenize_detokenize(http, llm):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == llm.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    tok = llm.tokenizer
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]),
                                        add_special_tokens=False)
    # OpenAI-style content parts are joined into the template's string content
    parts = http.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert parts.json()["tokens"] == chat["tokens"]


# -- errors -------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {**COMP, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**COMP, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**COMP, "n": "many"}, 400, "n"),
    ("/v1/completions", {**COMP, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**COMP, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {**COMP, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "model": "nope", "stream": True}, 404, "model"),
])
def test_invalid_requests(http, path, body, status, param):
    assert_envelope(http.post(path, json=body), status, param)


def test_prompt_over_context(http):
    for path, body in (("/v1/completions", {**COMP, "prompt": list(range(100, 100 + MAX_LEN))}),
                       ("/v1/completions", {**COMP, "prompt": "hello " * MAX_LEN, "stream": True}),
                       ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * MAX_LEN}]})):
        err = assert_envelope(http.post(path, json=body), 400)
        assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens"), err
        assert err["code"] == "context_length_exceeded", err


def test_malformed_and_oversized_and_unknown_route(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_envelope(r, 400)
    r = http.post("/v1/completions", json={**COMP, "prompt": "x" * (MAX_BODY + 10)})
    assert_envelope(r, 413)
    assert_envelope(http.get("/v1/nothing-here"), 404)
    assert http.get("/health").status_code == 200  # the server is fine afterwards


# -- load: queue bound, disconnects, concurrency ------------------------------------------------------

def _long_stream_body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}


def test_queue_full_then_disconnects_free_everything(server, http):
    """MAX_SEQS running + MAX_QUEUED waiting are accepted, the next gets 503; dropping them all frees the KV."""
    async def run():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=MAX_SEQS + MAX_QUEUED + 4)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=120) as ac:
            held = []
            try:
                for i in range(MAX_SEQS + MAX_QUEUED):
                    req = ac.build_request("POST", "/v1/completions", json=_long_stream_body(i))
                    r = await ac.send(req, stream=True)
                    held.append(r)
                    assert r.status_code == 200, await r.aread()
                over = await ac.post("/v1/completions", json={**_long_stream_body(99), "stream": False})
                return over
            finally:
                for r in held:
                    await r.aclose()

    over = asyncio.run(run())
    err = assert_envelope(over, 503)
    assert err["code"] == "queue_full" and over.headers.get("retry-after")
    text = wait_idle(http)
    assert metric(text, "ferry:request_success_total", finished_reason="abort") >= MAX_SEQS + MAX_QUEUED


def test_disconnect_aborts_and_frees_kv(server, http):
    before = http.get("/metrics").text
    gen0 = metric(before, "ferry:generation_tokens_total")
    aborts0 = metric(before, "ferry:request_success_total", finished_reason="abort")
    with http.stream("POST", "/v1/completions", json=_long_stream_body(0)) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # data, blank, data: two tokens arrived
        assert got[0].startswith("data: ")
        assert metric(http.get("/metrics").text, "ferry:kv_cache_usage_perc") > 0
    # a non-streaming request whose client gives up is aborted as well
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**_long_stream_body(1), "stream": False}, timeout=1.5)
    text = wait_idle(http)
    assert metric(text, "ferry:request_success_total", finished_reason="abort") == aborts0 + 2
    assert metric(text, "ferry:generation_tokens_total") - gen0 < 300  # nowhere near 2 x 400


def test_32_concurrent_streams_match_offline(server, llm):
    prompts = [f"Write the number {i} in words:" for i in range(32)]

    async def one(ac, p):
        text, reasons = [], []
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            else:
                usage = chunk.usage
        return "".join(text), reasons[-1], usage

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(run())
    want = llm.generate(prompts, greedy(6))
    for (text, reason, usage), o in zip(got, want):
        assert text == o.outputs[0].text
        assert reason == o.outputs[0].finish_reason
        assert usage.completion_tokens == len(o.outputs[0].token_ids)
    assert len({t for t, _, _ in got}) > 1  # independent outputs, not one answer copied around


def test_metrics_names_and_labels(http):
    text = http.get("/metrics").text
    for name in ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc",
                 "ferry:prompt_tokens_total", "ferry:generation_tokens_total", "ferry:num_preemptions_total",
                 "ferry:prefix_cache_queries_total", "ferry:prefix_cache_hits_total"):
        metric(text, name, model_name=MODEL)
    for name in ("ferry:time_to_first_token_seconds", "ferry:inter_token_latency_seconds",
                 "ferry:e2e_request_latency_seconds", "ferry:request_queue_time_seconds"):
        assert metric(text, name + "_count", model_name=MODEL) > 0
        assert metric(text, name + "_bucket", model_name=MODEL, le="+Inf") > 0
    assert metric(text, "ferry:request_success_total", model_name=MODEL, finished_reason="length") > 0
    assert metric(text, "ferry:prompt_tokens_total") > 0 and metric(text, "ferry:prefix_cache_queries_total") > 0


# -- life-cycle states, in process (a loading gate and a step that raises cannot be forced from outside) -----

def test_health_503_while_loading_a_failed_step_fails_its_requests_and_repeated_failures_kill(tiny_llama):
    from ferrylm.engine.async_engine import MAX_STEP_FAILURES, AsyncEngine
    from ferrylm.server.app import ServerConfig, create_app

    release = threading.Event()

    def build():
        release.wait(60)
        return LLM(tiny_llama, max_num_seqs=2, max_model_len=64).engine

    engine = AsyncEngine(build)
    app = create_app(engine, ServerConfig(served_model_names=("tiny",)))
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}

    async def run():
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://ferry") as c:
            assert (await c.get("/health")).json() == {"status": "loading"}
            assert_envelope(await c.post("/v1/completions", json=body), 503)
            assert_envelope(await c.get("/v1/models"), 503)
            release.set()
            await engine.wait_loaded()
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

            def boom():
                raise RuntimeError("injected step failure")

            engine.engine.step = boom  # the engine thread is idle: it calls this on the next request
            assert_envelope(await c.post("/v1/completions", json=body), 500)  # one failed step: its requests fail
            assert (await c.get("/health")).status_code == 200  # ... and the server keeps serving
            del engine.engine.step
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert engine.stats.kv_cache_usage == 0

            engine.engine.step = boom
            for _ in range(MAX_STEP_FAILURES - 1):
                assert_envelope(await c.post("/v1/completions", json=body), 500)
            assert_envelope(await c.post("/v1/completions", json=body), 503)  # failing on and on: dead
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "dead" and "injected" in h.json()["error"]
            assert_envelope(await c.post("/v1/completions", json=body), 503)

    asyncio.run(run())


# -- shutdown (last: it stops the session's server) ---------------------------------------------------

def test_sigterm_drains_in_flight_then_exits_cleanly(server, http):
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [first] + list(lines)
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # finished, not cut short
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert server.stop() == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
