"""Engine semantics on a tiny random model with token-id prompts (no tokenizer needed)."""

import pytest

from ferrylm import LLM, SamplingParams
from ferrylm.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=8, max_model_len=128)


P = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 101, 102, 103, 104, 105, 106]]


def ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_greedy_is_deterministic(llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert ids(llm.generate(P, sp)) == ids(llm.generate(P, sp))


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = ids(llm.generate([P[0]], sp))[0]
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([P[1], P[0], P[2]], [other, sp, other])
    assert mixed[1].outputs[0].token_ids == alone
    assert ids(llm.generate([P[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)))[0] != alone


def test_n_completions_with_seed_differ_and_repeat(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    a = ids(llm.generate([P[0]], sp))
    assert len(a) == 3 and len({tuple(x) for x in a}) == 3
    assert ids(llm.generate([P[0]], sp)) == a


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    greedy = ids(llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))[0]
    stop = greedy[3]
    out = llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == greedy[:greedy.index(stop) + 1]


def test_context_length_ends_generation(llm):
    prompt = list(range(120))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token


def test_bad_requests_are_refused_and_leave_nothing(llm):
    free = llm.engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match="maximum context length is 128"):
        llm.generate([list(range(200))], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 999]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams())
    # a bad prompt after good ones: the good ones are withdrawn too
    with pytest.raises(InvalidRequestError):
        llm.generate([P[0], list(range(200))], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free


def test_a_failed_step_leaves_nothing_and_the_next_call_runs(llm, monkeypatch):
    """A step that raises mid-generate (a host expert worker's failure, out of memory, Ctrl-C): the call's
    requests are withdrawn, so a later call neither steps them nor takes their outputs for its own."""
    eng = llm.engine
    free = eng.block_manager.num_free_blocks
    want = llm.generate(P, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    real, calls = eng.runner.execute, []

    def fail_third(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real(*a, **kw)

    monkeypatch.setattr(eng.runner, "execute", fail_third)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(P, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == free
    got = llm.generate(P[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert ids(got) == ids(want[:1])


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free = eng.block_manager.num_free_blocks
    rid = eng.add_request(P[2], SamplingParams(max_tokens=100, ignore_eos=True))
    eng.add_request(P[1], SamplingParams(max_tokens=100, ignore_eos=True), request_id="other")
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_free_blocks < free
    eng.abort_request(rid)
    eng.abort_request("other")
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == free


def test_prefix_cache_hit_gives_same_output(llm):
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks of 16 can be reused
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], sp)[0]
    hits = llm.engine.block_manager.prefix_hits
    second = llm.generate([prompt], sp)[0]
    assert second.num_cached_tokens == 48 and llm.engine.block_manager.prefix_hits == hits + 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=float("nan")), "temperature"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(n=10_000), "n must be"), (dict(max_tokens=0), "max_tokens"), (dict(logprobs=50), "logprobs"),
])
def test_invalid_sampling_values(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"), (dict(max_model_len=-5), "max_model_len"),
    (dict(model_overrides={"nonsense": 1}), "nonsense"),
])
def test_invalid_engine_options(tiny_llama, kw, match):
    from ferrylm.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        LLM(tiny_llama, **kw)


def test_every_knob_on_by_default_has_a_flag_that_turns_it_off():
    """Engine flags come from the config's fields (`cli.add_engine_args`): a bool that defaults to True is
    spelled `--no-<name>` (a store_true flag for it could never change anything)."""
    from ferrylm.cli import _engine_fields, build_parser, engine_kwargs

    on = [f.name for f, _ in _engine_fields() if str(f.type) == "bool" and f.default is True]
    assert {"mapped_experts", "hybrid_split", "enable_prefix_caching"} <= set(on)
    flags = ["--no-" + n.replace("_", "-").removeprefix("enable-") for n in on]
    base = engine_kwargs(build_parser().parse_args(["generate", "hi"]))
    off = engine_kwargs(build_parser().parse_args(["generate", "hi", *flags]))
    assert all(base[n] is True for n in on) and all(off[n] is False for n in on)
