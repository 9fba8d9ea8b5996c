"""Async scheduling (step N+1 launched before step N's tokens are read) against the synchronous loop, on the
CPU where it is forced on: the same tokens, texts, finish and stop reasons and logprobs for greedy and
seeded sampling, through EOS, stop ids, stop strings, max_tokens, preemption under a small KV pool, aborts
while a step is in flight, the synchronous fallback (penalties), and a real server streaming to the
`openai` client. The extra token a late stop computes is never shown."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ferrylm import LLM, SamplingParams

from helpers import byte_tokenizer

openai = pytest.importorskip("openai")


PROMPTS = ["The quick brown fox", "hello", "a b c d e f g h i j k l m n o p", "Once upon a time, there was",
           "x", "0123456789", "Lorem ipsum dolor sit amet", "zz"]


def _copy(src: str, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), dst)
    byte_tokenizer(str(dst))
    return str(dst)


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory) -> str:
    """The tiny random Llama with a byte tokenizer, its EOS a token greedy decoding produces early (so
    sequences really stop on EOS mid-run)."""
    d = _copy(tiny_llama, tmp_path_factory.mktemp("async-llama"))
    probe = LLM(d, async_scheduling="off")
    outs = probe.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    counts: dict[int, int] = {}
    for o in outs:
        for t in o.outputs[0].token_ids[2:12]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["eos_token_id"] = eos
    json.dump(cfg, open(cfg_path, "w"))
    return d


def pair(model: str, **kw) -> tuple[LLM, LLM]:
    return LLM(model, async_scheduling="off", **kw), LLM(model, async_scheduling="on", **kw)


def view(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def logprob_diff(a, b) -> float:
    """Largest |difference| of the logprobs two runs report (same keys required). A step's batch differs
    by the rows a late stop adds, so fp32 sums may round differently: tokens must match, logprobs closely."""
    worst = 0.0
    for x, y in zip(a, b):
        for c, d in zip(x.outputs, y.outputs):
            assert (c.logprobs is None) == (d.logprobs is None)
            for p, q in zip(c.logprobs or [], d.logprobs or []):
                assert p.keys() == q.keys()
                worst = max(worst, max(abs(p[k] - q[k]) for k in p))
    return worst


def drive(llm: LLM, prompts, params, wait_idle: bool = False) -> tuple[list, int]:
    """Generate step by step; returns (final outputs in prompt order, steps that ended with one in flight).
    `wait_idle`: `LLMEngine.wait_idle` (a timed window's start) after every third step, which leaves a launched
    step in flight."""
    e = llm.engine
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, overlapped, steps = {}, 0, 0
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.request_id not in final, "an output after the request finished"
            if o.finished:
                final[o.request_id] = o
        overlapped += e.rows_in_flight > 0
        steps += 1
        if wait_idle and steps % 3 == 0:
            rows = e.rows_in_flight
            e.wait_idle()
            assert e.rows_in_flight == rows
    # the last requests stopped one step late: the step launched beside their last one was dropped before step()
    # returned, so nothing outlives them (an offloaded model's registered host memory, a hybrid step's worker)
    assert e._inflight is None and e.rows_in_flight == 0
    assert e.step() == []
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks, "KV blocks leaked"
    return [final[i] for i in ids], overlapped


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=20),  # stops on EOS
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=5, max_tokens=15, logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.8, seed=9, max_tokens=25, logit_bias={5: 2.0}),
    ]


def test_greedy_and_seeded_sampling_match_sync(model):
    sync, asyn = pair(model, max_num_seqs=8)
    assert not sync.engine.async_scheduling and asyn.engine.async_scheduling
    want, _ = drive(sync, PROMPTS, mixed_params())
    got, overlapped = drive(asyn, PROMPTS, mixed_params())
    assert overlapped > 5, "async scheduling never had a step in flight"
    assert view(got) == view(want)
    worst = logprob_diff(got, want)
    print(f"async vs sync: max |logprob diff| = {worst:.2e}")
    assert worst < 1e-4
    assert any(o.outputs[0].finish_reason == "stop" for o in want), "no sequence stopped on EOS"
    assert asyn.engine.stats["generation_tokens"] == sync.engine.stats["generation_tokens"]


def test_stops_are_found_one_step_late_and_never_leak(model):
    sync, asyn = pair(model, max_num_seqs=8)
    free = sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # a stop string from the middle of each free-running text, and a stop id from the middle of its tokens
    params = []
    for i, o in enumerate(free):
        text, toks = o.outputs[0].text, o.outputs[0].token_ids
        if i % 3 == 0 and len(text) > 8:
            params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[5:7]],
                                         include_stop_str_in_output=i % 2 == 0))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[toks[6]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=3 + i))
    want, _ = drive(sync, PROMPTS, params)
    got, overlapped = drive(asyn, PROMPTS, params)
    assert overlapped > 0
    assert view(got) == view(want)
    reasons = {c.stop_reason for o in want for c in o.outputs if c.finish_reason == "stop"}
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons), reasons
    for o, f in zip(got, free):  # each output is a prefix of the free run: nothing past the stop
        assert o.outputs[0].token_ids == f.outputs[0].token_ids[:len(o.outputs[0].token_ids)]


def test_generate_returns_with_nothing_in_flight(model):
    """The last request stops on a token, found one step late: the step launched beside it is dropped before
    `generate` returns, so no step outlives the requests (on CUDA it could read an offloaded model's host memory
    after the engine is dropped, or wait for a hybrid step's host worker that is gone)."""
    sync, asyn = pair(model, max_num_seqs=2)
    free = sync.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[free.outputs[0].token_ids[5]])
    got = asyn.generate([PROMPTS[0]], sp)[0]
    assert got.outputs[0].finish_reason == "stop"
    assert asyn.engine.rows_in_flight == 0 and not asyn.engine.requests
    # that dropped step failing (a hybrid step's host worker, say) loses none of the outputs that just finished
    e, real = asyn.engine, asyn.engine.runner.check_step

    def check_step():
        if not e.requests:
            raise RuntimeError("injected: the dropped step failed")
        real()

    e.runner.check_step = check_step
    try:
        again = asyn.generate([PROMPTS[0]], sp)[0]
    finally:
        del e.runner.check_step
    assert again.outputs[0].token_ids == got.outputs[0].token_ids and e.rows_in_flight == 0


def test_preemption_under_a_small_pool(model):
    # 16-token budget chunks the prompts; 24 blocks of 4 tokens cannot hold 8 growing sequences
    kw = dict(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24)
    sync, asyn = pair(model, **kw)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)] * 4
    want, _ = drive(sync, PROMPTS, params)
    got, _ = drive(asyn, PROMPTS, params)
    assert asyn.engine.scheduler.num_preemptions > 0, "the small pool should have forced a preemption"
    assert view(got) == view(want)


def test_abort_while_a_step_is_in_flight(model):
    sync, asyn = pair(model, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = sync.generate(PROMPTS[:2], sp)
    e = asyn.engine
    keep, drop = e.add_request(PROMPTS[0], sp), e.add_request(PROMPTS[1], sp)
    for _ in range(6):
        assert {o.request_id for o in e.step()} <= {keep, drop}
    assert e._inflight is not None and any(s.request_id == drop for s in e._inflight.seqs)
    e.abort_request(drop)  # its row in the step in flight is dropped when that step is resolved
    after = []
    while e.has_unfinished_requests():
        after += e.step()
    after += e.step()
    assert after and all(o.request_id == keep for o in after), "an output for the aborted request"
    assert after[-1].finished and after[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    assert not e.requests


def test_penalties_fall_back_to_synchronous_steps(model):
    sync, asyn = pair(model, max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    want, _ = drive(sync, PROMPTS[:2], params)
    got, overlapped = drive(asyn, PROMPTS[:2], params)
    assert overlapped == 0, "a request with a penalty must run synchronous steps"
    assert view(got) == view(want)
    got, overlapped = drive(asyn, PROMPTS[:2], [params[1]] * 2)  # without it, steps overlap again
    assert overlapped > 0


def test_config_knob():
    from ferrylm.config import EngineConfig
    from ferrylm.errors import ConfigError

    assert EngineConfig().async_scheduling == "auto"
    assert EngineConfig(async_scheduling=True).async_scheduling == "on"
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="sometimes")


def test_server_streams_match_sync_and_abort_frees_kv(model):
    import asyncio

    import httpx
    from serving import Server, wait_idle

    sync = LLM(model, async_scheduling="off", max_num_seqs=8)
    free = sync.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = [None, [free[1].outputs[0].text[4:6]], None, None]
    params = [SamplingParams(temperature=0, max_tokens=12, stop=s) for s in stops]
    want = sync.generate(PROMPTS[:4], params)
    server = Server(["--model", model, "--async-scheduling", "on", "--max-num-seqs", "8", "--disable-access-log"])
    try:
        server.wait_ready(120)

        async def run():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as ac:
                async def one(p, s):
                    text, reasons = [], []
                    async for c in await ac.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                                               stop=s, stream=True):
                        text.append(c.choices[0].text)
                        reasons.append(c.choices[0].finish_reason)
                    return "".join(text), reasons[-1]

                return await asyncio.gather(*(one(p, s) for p, s in zip(PROMPTS[:4], stops)))

        got = asyncio.run(run())
        assert got == [(o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # abort mid-stream: close after the first chunk
            wait_idle(http)  # the aborted request left nothing running and no KV held
        assert asyncio.run(run()) == got  # and the engine still serves the same answers
    finally:
        rc = server.stop()
        log = server.log_text()
        os.unlink(server.log.name)
    assert rc == 0 and "Traceback" not in log, log


def test_length_stops_cost_no_extra_step(model):
    """A sequence whose pending token is its last (max_tokens) is not scheduled again: the async run samples
    exactly the rows the synchronous one does."""
    from helpers import capture_logits

    sync, asyn = pair(model, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    rows = []
    for llm in (sync, asyn):
        with capture_logits(llm.engine) as got:
            outs, _ = drive(llm, PROMPTS, params)
        rows.append(len(got))
    assert rows[0] == rows[1] == sum(p.max_tokens for p in params), rows


def test_graph_input_staging_on_the_cpu(model):
    """The CUDA path's staging of a decode graph's static buffers (one upload, padded tables, pending ids
    from the device), exercised on the CPU: `DecodeGraphs` with its replay run eagerly (no CUDA graph here)
    gives the engine the same tokens as the eager path, sync and async, and `ModelRunner._graph_step` the
    same logits as `DecodeGraphs.run` (the plain reference staging)."""
    import torch

    from ferrylm.engine.cuda_graph import DecodeGraphs
    from ferrylm.layers.context import forward_context

    class EagerReplay(DecodeGraphs):
        def _graph(self, Bb, nbb):
            ctx, ids, pos, logits = self._context(Bb, nbb), self.ids[:Bb], self.pos[:Bb], self.logits[:Bb]
            body, embed = self.body, self.embed

            class Replay:  # what capture would record: the body over the static buffers
                def replay(self):
                    with torch.inference_mode(), forward_context(ctx):
                        logits.copy_(body(embed(ids), pos))
            self.graphs[(Bb, nbb)] = (Replay(), logits)
            return self.graphs[(Bb, nbb)]

    def graphed(llm):
        r = llm.engine.runner
        r.graphs = EagerReplay(r.embed, lambda x, pos: r.model.compute_logits(r.run_layers(x, pos)), r.kv_cache,
                               8, r.max_model_len, r.model_config.vocab_size, r.device,
                               hidden_size=r.model_config.hidden_size, dtype=r.dtype)
        return llm

    kw = dict(max_num_seqs=8, block_size=4)
    sync, asyn = pair(model, **kw)
    want, _ = drive(sync, PROMPTS, mixed_params())
    for llm in (graphed(LLM(model, async_scheduling="off", **kw)), graphed(LLM(model, async_scheduling="on", **kw))):
        got, _ = drive(llm, PROMPTS, mixed_params())
        assert llm.engine.runner.graphs.graphs, "no step took the graph path"
        assert view(got) == view(want)
        assert logprob_diff(got, want) < 1e-4

    e = graphed(LLM(model, async_scheduling="off", **kw)).engine
    for p in PROMPTS[:5]:
        e.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        e.step()
    out = e.scheduler.schedule()
    assert e.runner.graphs.eligible(out)
    ref = e.runner.graphs.run(out).clone()
    assert torch.equal(e.runner._graph_step(out, None, 0.0), ref)


def test_prefix_cache_registers_the_same_blocks(model):
    """Blocks are hashed once their tokens are computed and known: with async scheduling a token is computed
    (as the next step's input) before it is known, and a sequence that stopped has run one step more.
    Continuations of the first wave's outputs must hit exactly the blocks the synchronous engine cached."""
    sync, asyn = pair(model, max_num_seqs=8, block_size=4)
    prefix = "shared system prompt: "
    first = [prefix + p for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=9 + i, ignore_eos=i % 2 == 0) for i in range(len(first))]
    runs = []
    for llm in (sync, asyn):
        a, _ = drive(llm, first, params)
        second = [o.prompt_token_ids + o.outputs[0].token_ids for o in a]
        b, _ = drive(llm, second, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(second))
        bm = llm.engine.block_manager
        runs.append((view(a), view(b), bm.prefix_hits, bm.prefix_queries))
    assert runs[1] == runs[0]
    assert runs[0][2] > 0, "the second wave should hit the prefix cache"


def test_offloaded_moe_matches_sync(tmp_path_factory):
    """An offloaded MoE (streamed layers, cached experts copied on the copy road) under async scheduling (on
    by default on CUDA since session 40's A/B, `benchmarks/ab_async_offload.py`; the CPU runs it when asked): the
    same greedy and seeded tokens as the synchronous loop, with steps really in flight."""
    from test_models_hf import build

    path, _ = build(tmp_path_factory, "mixtral")
    sync, asyn = pair(path, dtype="float32", max_num_seqs=4, place=("experts=cpu", "layers.1=cpu"),
                      gpu_memory_budget="1GiB")
    assert not asyn.engine.runner.placement.fully_resident and asyn.engine.runner.placed.streamer is not None
    prompts = [[1, 2, 3, 4, 5], [9, 3, 7, 200, 11, 12], [42] * 9]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1)]
    want, _ = drive(sync, prompts, params)
    got, overlapped = drive(asyn, prompts, params, wait_idle=True)
    assert overlapped > 3, "async scheduling never had a step in flight"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    st = asyn.engine.runner.placed.stats
    print(f"offloaded async: {overlapped} steps overlapped, {st}")
    assert st.copied_experts > 0 and st.h2d_bytes > 0
