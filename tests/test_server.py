"""End to end through a real `ferry serve` process on 127.0.0.1 (embedded default model, API key set).

One server for the whole session (loading is the slow part); the official `openai` client drives chat,
completions, streaming (sync and async), structured outputs and tool calls, httpx every error case and
each bug of issue 13 as a regression test, raw sockets the slow clients. Greedy outputs are compared with
the offline `LLM` in this process. Token budgets stay small: the file should run in about two minutes on
two busy cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from ferrylm import LLM, SamplingParams  # noqa: E402
from serving import Server, assert_envelope, metric, wait_idle  # noqa: E402

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 512
MAX_SEQS = 32
MAX_QUEUED = 8
MAX_BODY = 16 << 20
READ_TIMEOUT = 2.0
SERVER_ARGS = ["--api-key", API_KEY, "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(MAX_SEQS),
               "--max-queued-requests", str(MAX_QUEUED), "--max-request-bytes", str(MAX_BODY),
               "--shutdown-timeout", "30", "--disable-access-log", "--read-timeout", str(READ_TIMEOUT),
               "--metrics-compat", "vllm", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="session")
def server():
    s = Server(SERVER_ARGS)
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


def test_echo_with_logprobs_covers_the_prompt(http, llm):
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    want = llm.generate([ids], greedy(2, prompt_logprobs=2, logprobs=2))[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = c["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 2 and c["text"].startswith(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    for i in range(1, n):
        assert lp["token_logprobs"][i] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-4)
        assert len(lp["top_logprobs"][i]) == 2
    assert lp["token_logprobs"][n:] == pytest.approx([want.outputs[0].logprobs[k][t]
                                                      for k, t in enumerate(want.outputs[0].token_ids)], abs=1e-4)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][1:n] == pytest.approx(lp["token_logprobs"][1:n])


def test_echo_logprobs_as_lm_eval_asks_and_max_tokens_0(client, http, llm):
    """lm-evaluation-harness `local-completions` loglikelihood: token-id prompt, echo, logprobs 1, max_tokens 1,
    temperature 0, read over the prompt; then vLLM's echo-only form (max_tokens 0), streamed too."""
    ids = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    n = len(ids)
    want = llm.generate([ids], greedy(1, prompt_logprobs=1))[0].prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([want[i][ids[i]] for i in range(1, n)], abs=1e-4)
    assert all(len(top) == 1 and tlp <= max(top.values()) + 1e-6
               for tlp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    greedy_hits = sum(tlp == max(top.values()) for tlp, top in zip(lp.token_logprobs[1:n], lp.top_logprobs[1:n]))
    assert 0 < greedy_hits < n - 1  # lm-eval's is_greedy test: exact equality where the prompt token is the argmax
    # echo only: the prompt and its logprobs, nothing generated
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    assert c.text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert c.logprobs.tokens == lp.tokens[:n] and c.logprobs.token_logprobs == lp.token_logprobs[:n]
    r = client.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=0)
    assert r.choices[0].text == "Hello there" and r.choices[0].logprobs is None and r.usage.completion_tokens == 0
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c.text
    assert [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]] == c.logprobs.tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_and_logprobs_bad_combinations_are_400(http):
    base = {"model": MODEL, "prompt": "Hello", "temperature": 0}
    assert_envelope(http.post("/v1/completions", json={**base, "max_tokens": 0}), 400, "max_tokens")
    assert_envelope(http.post("/v1/completions", json={**base, "echo": True, "logprobs": 21}), 400, "logprobs")
    assert_envelope(http.post("/v1/completions", json={**base, "echo": True, "max_tokens": 0, "logprobs": -1}),
                    400, "logprobs")
    assert_envelope(http.post("/v1/completions", json={**base, "echo": True, "max_tokens": -1}), 400, "max_tokens")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert_envelope(http.post("/v1/chat/completions", json={**chat, "echo": True, "max_tokens": 0}), 400, "max_tokens")
    assert_envelope(http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 21}),
                    400, "top_logprobs")


def _check_vllm_prompt_logprobs(plp: list, ids: list[int], want, num: int, tok, tol: float = 1e-4) -> None:
    """vLLM's `prompt_logprobs` against the offline engine's: values, decoded tokens, and ranks read off the
    top `num` (rank r <= num iff the token is among them, r = 1 + how many of them score higher). A loose
    `tol` (prompts batched differently) compares the prompt token's value only (near-ties may swap the top)."""
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        d = plp[i]
        own = d[str(ids[i])]
        assert num <= len(d) <= num + 1
        if tol <= 1e-4:
            assert set(d) == {str(t) for t in want.prompt_logprobs[i]}
            assert all(e["logprob"] == pytest.approx(want.prompt_logprobs[i][int(t)], abs=tol) for t, e in d.items())
        assert own["logprob"] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=tol)
        for t, e in d.items():
            assert e["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False)
            assert e["rank"] >= 1
        top = sorted((e for t, e in d.items() if t != str(ids[i]) or own["rank"] <= num), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in top[:num]] == list(range(1, num + 1))  # the argmax has rank 1, and so on
        if own["rank"] <= num:
            assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in d.values())
        else:  # ranked below the top num: no higher than the last of them
            assert own["logprob"] <= top[num - 1]["logprob"] and len(d) == num + 1


def test_prompt_logprobs_vllm_field_on_completions(client, llm):
    """vLLM's `prompt_logprobs: N` through the openai client (extra_body): per choice, one entry per prompt
    token, equal to the engine's and to the echo + logprobs form in the same answer."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    tok = llm.tokenizer
    ids = tok.encode(prompt)
    want = llm.generate([ids], greedy(2, prompt_logprobs=20))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 20})
    c = r.choices[0]
    _check_vllm_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, want, 20, tok)
    assert c.logprobs is None and not c.text.startswith(prompt)  # no echo: the default fields unchanged
    assert any(e[str(ids[i])]["rank"] > 20 for i, e in enumerate(c.model_extra["prompt_logprobs"]) if e)
    assert any(e[str(ids[i])]["rank"] == 1 for i, e in enumerate(c.model_extra["prompt_logprobs"]) if e)
    # with echo + logprobs 1 in the same request (the engine computes the larger top-n once), n = 2 choices
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=1, temperature=0, echo=True,
                                  logprobs=1, n=2, extra_body={"prompt_logprobs": 3})
    assert len(r.choices) == 4
    # the server may prefill the two prompts in one step or two: the quantized kernels' numerics depend on the
    # batch shape (measured up to 0.024 at logprob -11.5 against each prompt alone)
    wants = llm.generate([ids, ids[:5]], greedy(1, prompt_logprobs=3, n=2))
    for k, c in enumerate(r.choices):
        p = ids if k < 2 else ids[:5]
        plp = c.model_extra["prompt_logprobs"]
        _check_vllm_prompt_logprobs(plp, p, wants[k // 2], 3, tok, tol=0.1)
        assert plp == r.choices[k ^ 1].model_extra["prompt_logprobs"]  # the n choices of a prompt share them
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and len(lp.top_logprobs[1]) == 1
        assert lp.token_logprobs[1:len(p)] == pytest.approx([plp[i][str(p[i])]["logprob"] for i in range(1, len(p))],
                                                            abs=1e-6)
    # prompt_logprobs 0: the prompt token's own entry only
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert all(len(e) == 1 for e in r.choices[0].model_extra["prompt_logprobs"][1:])


def test_prompt_logprobs_vllm_field_on_chat(client, http, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    want = llm.generate([ids], greedy(2, prompt_logprobs=2))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    _check_vllm_prompt_logprobs(r.model_extra["prompt_logprobs"], ids, want, 2, llm.tokenizer)  # beside choices
    assert "prompt_logprobs" not in r.choices[0].model_extra


def test_chat_echo_and_continue_final_message(client, http, llm):
    """vLLM's chat `echo`: an assistant prefill continued (`continue_final_message`) comes back whole, streamed
    too; a last message from the user echoes nothing."""
    tok = llm.tokenizer
    prefill = "The capital of France is"
    messages = [{"role": "user", "content": "Tell me about France."}, {"role": "assistant", "content": prefill}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered.rstrip().endswith("<|im_end|>")  # without continue_final_message the turn is closed
    ids = tok.encode(rendered[:rendered.rindex(prefill) + len(prefill)], add_special_tokens=False)
    want = llm.generate([ids], greedy(4))[0].outputs[0].text
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra}).json()["tokens"]
    assert tokenized == ids
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == prefill + want and r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body=extra, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == prefill + want
    # continue_final_message alone: the continuation only
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={**extra, "echo": False})
    assert r.choices[0].message.content == want
    # the last message is the user's: nothing to echo
    user = messages[:1]
    plain = client.chat.completions.create(model=MODEL, messages=user, max_tokens=3, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=user, max_tokens=3, temperature=0,
                                       extra_body={"echo": True})
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_prompt_logprobs_and_chat_echo_bad_values_are_400(http):
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
        for bad in (21, -1, "x", 1.5):
            assert_envelope(http.post(path, json={**body, "prompt_logprobs": bad}), 400, "prompt_logprobs")
        err = assert_envelope(http.post(path, json={**body, "prompt_logprobs": 1, "stream": True}), 400,
                              "prompt_logprobs")
        assert "stream" in err["message"]
    assert_envelope(http.post("/v1/chat/completions", json={**chat, "continue_final_message": True}), 400,
                    "continue_final_message")  # add_generation_prompt is true by default
    empty = {**chat, "messages": chat["messages"] + [{"role": "assistant", "content": " "}],
             "add_generation_prompt": False, "continue_final_message": True}
    assert_envelope(http.post("/v1/chat/completions", json=empty), 400, "continue_final_message")


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
    # values that would overflow in the sampler (1e-300 rounds to 0 in fp32: NaN logprobs, once a 500)
    ("/v1/completions", {**COMP, "repetition_penalty": 1e-300, "logprobs": 2}, 400, "repetition_penalty"),
    ("/v1/completions", {**COMP, "repetition_penalty": 1e-300, "stream": True}, 400, "repetition_penalty"),
    ("/v1/completions", {**COMP, "temperature": 1e39}, 400, "temperature"),
    ("/v1/completions", {**COMP, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {**COMP, "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {**COMP, "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {**COMP, "guided_regex": "[0-9"}, 400, "guided_regex"),
    ("/v1/completions", {**COMP, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {**COMP, "guided_regex": "a", "guided_choice": ["b"]}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/completions", {**COMP, "prompt": ["x"] * (MAX_SEQS + MAX_QUEUED + 1)}, 400, "prompt"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", None, 400, None),
])
def test_invalid_requests(http, path, body, status, param):
    assert_envelope(http.post(path, json=body), status, param)


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
])
def test_lone_surrogates_are_400(http, path, raw, param):
    """JSON may spell a lone surrogate (\\ud800), which no tokenizer or UTF-8 encoder accepts (once a 500)."""
    r = http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_envelope(r, 404 if param == "model" else 400, param)


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity (Python's json accepts them; JSON does not)."""
    def no_constant(name):
        raise ValueError(f"non-JSON constant {name}")
    return json.loads(text, parse_constant=no_constant)


def test_logprobs_always_finite(http):
    """A grammar leaves one token possible: the other top logprobs are -inf inside, -9999.0 on the wire."""
    body = {**COMP, "guided_choice": ["yes"], "logprobs": 5, "max_tokens": 3}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = _strict_json(r.text)["choices"][0]["logprobs"]
    tops = [v for d in lp["top_logprobs"] for v in d.values()]
    assert min(tops) == -9999.0 and max(tops) <= 0
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("logprobs" in _strict_json(e)["choices"][0] for e in events[:-1])


def test_model_ids_are_matched_exactly(http):
    for path in ("/v1/models/", "/v1/models/%0A", f"/v1/models/{MODEL}%0A", f"/v1/models/{MODEL}/", "/v1/models/x"):
        err = assert_envelope(http.get(path), 404, "model")
        assert err["code"] == "model_not_found"
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_envelope(http.post("/v1/completions", json={**COMP, "model": MODEL + "\n"}), 404, "model")


def test_chat_template_kwargs_cannot_clash(http):
    for kwargs in ({"self": 1}, {"messages": []}, {"add_generation_prompt": False, "1bad": 2}):
        r = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text


def test_405_names_the_allowed_methods(http):
    r = http.get("/v1/completions")
    assert_envelope(r, 405)
    assert r.headers["allow"] == "POST"
    r = http.post("/v1/models")
    assert_envelope(r, 405)
    assert r.headers["allow"] == "GET"


def test_openapi_documents_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert "properties" in schemas[name]
    for field in ("prompt", "max_tokens", "logprobs", "echo", "best_of", "logit_bias", "guided_json", "response_format"):
        assert field in schemas["CompletionRequest"]["properties"], field
    for field in ("messages", "tools", "tool_choice", "response_format", "top_logprobs"):
        assert field in schemas["ChatCompletionRequest"]["properties"], field
    assert "ErrorResponse" in schemas


def test_logit_bias_and_best_of(http, llm):
    want = llm.tokenizer.encode(" banana", add_special_tokens=False)[-1]
    r = http.post("/v1/completions", json={**COMP, "temperature": 0, "max_tokens": 1, "logit_bias": {str(want): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == llm.tokenizer.decode([want])
    r = http.post("/v1/completions", json={**COMP, "max_tokens": 3, "ignore_eos": True, "n": 2, "best_of": 4,
                                           "seed": 5}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 4 * 3  # all four were generated


def test_a_request_larger_than_the_queue_is_400_not_503(http):
    before = metric(http.get("/metrics").text, "ferry:request_success_total", finished_reason="abort")
    body = {**COMP, "prompt": ["x"] * (MAX_SEQS + MAX_QUEUED + 1)}
    err = assert_envelope(http.post("/v1/completions", json=body), 400, "prompt")
    assert err["code"] == "too_many_prompts"
    r = http.post("/v1/completions", json={**COMP, "prompt": ["x"] * (MAX_SEQS + MAX_QUEUED)})  # fits, idle server
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQS + MAX_QUEUED
    after = metric(wait_idle(http), "ferry:request_success_total", finished_reason="abort")
    assert after == before  # a refused request was never queued, so nothing was aborted


def test_huge_prompt_does_not_block_the_event_loop(server, http):
    """A prompt that takes seconds to tokenize; /health answers meanwhile (FERRY_TEST_PROMPT_MB=15: the issue's size)."""
    mb = float(os.environ.get("FERRY_TEST_PROMPT_MB", "1.5"))
    data = json.dumps({**COMP, "prompt": "hello world, " * int(mb * 1e6 / 13)}).encode()  # encoded up front:
    result = {}  # the client's own GIL-holding work would show up as server latency

    def big():
        t0 = time.perf_counter()
        result["r"] = http.post("/v1/completions", content=data, timeout=600)
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=big)
    lat = []
    with httpx.Client(base_url=server.url) as c:
        c.get("/health")  # connected before timing
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    t.join()
    err = assert_envelope(result["r"], 400)
    assert err["code"] == "context_length_exceeded"
    assert len(lat) > 20, lat  # it really ran while the prompt was tokenized
    print(f"/health while a {mb} MB prompt was read and tokenized: {len(lat)} calls, "
          f"max {max(lat) * 1e3:.0f} ms, 2nd {sorted(lat)[-2] * 1e3:.0f} ms; the request took {result['s']:.2f} s")
    # A blocked loop answers /health only after the whole read-and-tokenize, seconds here. Answers within a
    # quarter of that (and half a second) show it was free; one slow answer allowed, and a loaded 2-core CI
    # machine has shown 200 ms stalls from GIL contention with the tokenizer thread, so no tighter bound.
    assert sorted(lat)[-2] < min(0.5, result["s"] / 4), (sorted(lat)[-5:], result["s"])


def _raw(server, data: bytes) -> tuple[float, bytes]:
    """Send `data` on a raw socket and read until the server closes it; (seconds to close, what came back)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(READ_TIMEOUT * 5)
        s.sendall(data)
        t0, got = time.monotonic(), b""
        while chunk := s.recv(65536):
            got += chunk
        return time.monotonic() - t0, got


@pytest.mark.parametrize("data", [
    b"",  # connects and says nothing
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never finish
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
    + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ",  # body stops
])
def test_slow_clients_are_cut_off(server, data):
    secs, got = _raw(server, data)
    assert READ_TIMEOUT * 0.8 < secs < READ_TIMEOUT + 3, secs
    assert got.startswith(b"HTTP/1.1 408"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


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


# -- structured outputs and tool calls -----------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def _is_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 12 and type(obj["age"]) is int and 0 <= obj["age"] <= 150)


def test_json_schema_output_always_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], n=20, seed=7,
        temperature=1.0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(r.choices) == 20
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert _is_person(json.loads(c.message.content)), c.message.content
    assert len(set(texts)) > 1  # sampled, not one answer repeated


def test_json_object_regex_choice(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "seed": 1, "temperature": 0.7,
                                                "response_format": {"type": "json_object"}}).json()
    text = r["choices"][0]["message"]["content"]
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert text.lstrip().startswith("{"), text
    for n, seed in ((4, 3),):
        r = http.post("/v1/completions", json={**COMP, "prompt": "My number:", "guided_regex": r"[0-9]{3}-[0-9]{4}",
                                               "max_tokens": 20, "n": n, "seed": seed}).json()
        for c in r["choices"]:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c["text"]) and c["finish_reason"] == "stop", c
    r = http.post("/v1/completions", json={**COMP, "prompt": "Colour:", "guided_choice": ["red", "green", "blue"],
                                           "n": 6, "seed": 2, "max_tokens": 10}).json()
    assert {c["text"] for c in r["choices"]} <= {"red", "green", "blue"}
    with http.stream("POST", "/v1/completions", json={**COMP, "prompt": "Colour:", "stream": True, "max_tokens": 10,
                                                      "guided_choice": ["red", "green", "blue"]}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) in {"red", "green", "blue"}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client, tool_choice):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                       max_tokens=40, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if tool_choice == "required":
        assert call.function.name in ("get_weather", "get_time") and r.choices[0].finish_reason == "tool_calls"
    else:
        assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    # streamed, the deltas add up to the same call
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice=tool_choice, max_tokens=40, temperature=0, stream=True)
    name, arguments, ids, reasons = "", "", set(), []
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            ids.add(d.id) if d.id else None
            name += (d.function.name or "") if d.function else ""
            arguments += (d.function.arguments or "") if d.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert name == call.function.name and json.loads(arguments) == args and len(ids) == 1
    assert reasons[-1] == r.choices[0].finish_reason
    # the result goes back to the model, which answers in text
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_tool_choice_auto_parses_hermes_calls(http):
    """With --tool-call-parser hermes, a `<tool_call>` the model writes comes back parsed (forced here by a regex)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = {**CHAT, "tools": [WEATHER], "max_tokens": 60, "guided_regex": re.escape(call)}
    r = http.post("/v1/chat/completions", json=body).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (tc,) = c["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Oslo"}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert not any("<tool_call>"[:k] in (d.get("content") or "") for d in deltas for k in (3,))  # never shown
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


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
    """32 streams at once give what offline generation gives, token for token, up to a numerical tie.

    The server batches the streams as they arrive, offline all at once, so each token is computed in a
    differently shaped batch (padded decode attention, prefill chunks); the floats differ in the last bits and
    a greedy pick between two near-equal logits may flip (seen about one run in seven on 2 cores). As vLLM's
    `check_logprobs_close`: the two agree token by token until they first differ, and there each side's token
    must be among the other's top 5 with a logprob within `TIE` of its top; after a tie nothing more is
    compared for that prompt. Crossed or corrupted streams fail: their tokens are nowhere near the top."""
    TIE = 0.25
    prompts = [f"Write the number {i} in words:" for i in range(32)]

    async def one(ac, p):
        text, reasons, lps = [], [], []
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True,
                                             logprobs=5, stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
                if chunk.choices[0].logprobs is not None:
                    lps.extend(chunk.choices[0].logprobs.top_logprobs)
            else:
                usage = chunk.usage
        return "".join(text), reasons[-1], usage, lps

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(run())
    want = llm.generate(prompts, greedy(6, logprobs=5))
    tok = llm.tokenizer
    ties = 0
    for (text, reason, usage, lps), o in zip(got, want):
        out = o.outputs[0]
        assert len(lps) == usage.completion_tokens
        if text == out.text:
            assert reason == out.finish_reason
            assert usage.completion_tokens == len(out.token_ids)
            continue
        # the first token where the two differ: offline's [{id: logprob}] vs the server's [{token text: logprob}]
        i = next(i for i, t in enumerate(out.token_ids) if i >= len(lps) or max(lps[i], key=lps[i].get)
                 != tok.decode([t], skip_special_tokens=False))
        assert i < len(lps), f"{o.prompt!r}: the stream stopped early: {text!r} vs {out.text!r}"
        mine = {tok.decode([t], skip_special_tokens=False): v for t, v in out.logprobs[i].items()}
        theirs = max(lps[i], key=lps[i].get)
        offline = tok.decode([out.token_ids[i]], skip_special_tokens=False)
        print(f"{o.prompt!r}: tie at token {i}: server {theirs!r} {lps[i][theirs]:.3f} / {lps[i].get(offline)}, "
              f"offline {offline!r} {mine[offline]:.3f} / {mine.get(theirs)}")
        assert theirs in mine and mine[offline] - mine[theirs] < TIE, f"{o.prompt!r}: {text!r} vs {out.text!r}"
        assert offline in lps[i] and lps[i][theirs] - lps[i][offline] < TIE, f"{o.prompt!r}: {text!r} vs {out.text!r}"
        ties += 1
    assert ties <= 4, f"{ties} of 32 prompts diverged: more than float noise"
    assert len({t for t, _, _, _ in got}) > 1  # independent outputs, not one answer copied around


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
    # vLLM's request histograms; the per-request token counts add up to the counters
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                 "iteration_tokens_total", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_params_n", "request_params_max_tokens",
                 "time_per_output_token_seconds"):
        assert metric(text, f"ferry:{name}_count", model_name=MODEL) > 0, name
    finished = sum(metric(text, "ferry:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert metric(text, "ferry:request_generation_tokens_count") == finished
    assert metric(text, "ferry:request_generation_tokens_sum") <= metric(text, "ferry:generation_tokens_total")
    assert metric(text, "ferry:iteration_tokens_total_sum") >= metric(text, "ferry:generation_tokens_total")
    info = [line for line in text.splitlines() if line.startswith("ferry:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and info[0].endswith(" 1.0"), info
    # process collectors, and --metrics-compat vllm: every ferry: series again under vLLM's name
    assert metric(text, "process_resident_memory_bytes") > 0 and metric(text, "process_cpu_seconds_total") > 0
    ferry = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ferry:")}
    vllm = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    assert {n.replace("ferry:", "vllm:", 1) for n in ferry} | {"vllm:gpu_cache_usage_perc"} == vllm
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in vllm, name
    assert metric(text, "vllm:generation_tokens_total") == metric(text, "ferry:generation_tokens_total")
    assert metric(text, "vllm:gpu_cache_usage_perc") == metric(text, "ferry:kv_cache_usage_perc")  # v0's name


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
