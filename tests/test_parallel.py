"""Tensor and expert parallelism on the CPU (gloo, 2 ranks = 2 processes): tiny random-weight checkpoints
written by transformers, each parallel engine against the single-process engine on the same files.

fp32 tolerance: a sharded model sums its row-parallel products (and the expert outputs) over ranks in
another order than one process does, so logits differ by float rounding only: we allow 1e-4 (the
max difference is printed; it is ~1e-6 here). Greedy tokens must be identical.
Each parallel engine start costs a few seconds on two cores (two interpreters import torch), so each
one is built once per module and shared.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.errors import ConfigError, WorkerLostError  # noqa: E402

from helpers import byte_tokenizer, capture_logits  # noqa: E402

TOL = 1e-4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
SMALL_POOL = dict(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24)
"""16-token budget chunks every prompt; 24 blocks of 4 tokens cannot hold 6 sequences of ~60 tokens."""


def build(tmp_path_factory, name: str, cfg_cls: str, model_cls: str, **extra) -> str:
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # widen the tiny random init so a wrong shard would show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


def prompts(lens, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def run(llm, ps, steps):
    """(greedy token ids per prompt, logits [steps, V] per prompt)."""
    with capture_logits(llm.engine) as got:
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    by_seq: dict[int, list] = {}
    for sid, row in got:
        by_seq.setdefault(sid, []).append(row)
    return [o.outputs[0].token_ids for o in outs], [torch.stack(by_seq[s]) for s in sorted(by_seq)]


def compare(name, ref, got):
    (ref_tok, ref_logits), (tok, logits) = ref, got
    diff = max((a - b).abs().max().item() for a, b in zip(ref_logits, logits))
    print(f"{name}: max |logit diff| vs one process = {diff:.3e}")
    assert diff < TOL
    assert tok == ref_tok


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in this process too: two ranks share two cores (OpenMP barriers thrash otherwise)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def engines():
    """Parallel engines built in this module, closed at its end (nothing may be left running)."""
    made = []

    def make(path, **kw):
        llm = LLM(path, dtype="float32", **kw)
        made.append(llm)
        return llm
    yield make
    procs = [p for llm in made for p in getattr(llm.engine.runner, "procs", {}).values()]
    for llm in made:
        llm.engine.close()
    assert all(p.exitcode is not None for p in procs), "a worker outlived its engine"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = build(tmp_path_factory, "llama", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llama_tp(llama, engines):
    return engines(llama, tensor_parallel_size=2, **SMALL_POOL)


# -- tensor parallelism ------------------------------------------------------------------------------------


def test_tp2_batched_with_preemption_equals_one_process_alone(llama, llama_tp):
    ps = prompts([37, 5, 60, 1, 23, 48])
    alone = LLM(llama, dtype="float32", max_num_seqs=1, enable_prefix_caching=False)
    ref = [run(alone, [p], 12) for p in ps]
    tok, logits = run(llama_tp, ps, 12)
    assert llama_tp.engine.scheduler.num_preemptions > 0, "the small pool should have forced a preemption"
    compare("llama TP=2 batched (preempted) vs alone", ([t for r in ref for t in r[0]], [r[1][0] for r in ref]),
            (tok, logits))
    assert llama_tp.engine.block_manager.num_free_blocks == SMALL_POOL["num_kv_blocks"]
    # each rank caches its own KV heads: 2 heads over 2 ranks
    assert llama_tp.engine.runner.kv_cache.k.shape[-2] == 1


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_tp2_keeps_a_quantized_stores_linears_packed(quant, llama, engines, tmp_path_factory):
    """A ferry store with packed Linear weights under TP=2: each rank keeps its slice of a Linear packed
    (`QuantizedTensor.narrow`: rows of a column-parallel weight, whole groups of columns of a row-parallel one),
    where before every slice was read dense; a slice that would cut a group (NF4's 64 columns against o_proj's 32
    and down_proj's 48 a rank) is read dense. NF4's logits equal one process's on the same store within the partial
    sums' rounding; int8's CPU kernel quantizes each row of activations over the columns it holds
    (`layers/qmatmul.py`), so a rank's half gets its own scale: its prefill logits agree within that quantization
    (one process against the dense checkpoint differs by ~0.025 here), and so does the first token unless its top
    two logits are that close."""
    from ferrylm.weights.convert import ConvertOptions, convert

    store = str(tmp_path_factory.mktemp(f"tp-{quant}") / "s")
    convert(llama, store, ConvertOptions(quant=quant))
    byte_tokenizer(store)
    ps = prompts([37, 5, 23])
    ref = run(LLM(store, dtype="float32", max_num_seqs=4, enable_prefix_caching=False), ps, 8)
    tp = engines(store, tensor_parallel_size=2, max_num_seqs=4, enable_prefix_caching=False)
    layer = tp.engine.runner.model.model.layers[0]
    packed = {n: bool(m.kernels) for n, m in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                              ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj))}
    print(f"{quant} TP=2, rank 0's layer 0 packed: {packed}")
    assert packed["qkv"] and packed["gate_up"] and packed["o"] == packed["down"] == (quant == "int8")
    got = run(tp, ps, 8)
    if quant == "nf4":
        compare(f"{quant} store TP=2 vs one process", ([t for r in ref[0] for t in r], ref[1]),
                ([t for r in got[0] for t in r], got[1]))
        return
    diff = max((a[0] - b[0]).abs().max().item() for a, b in zip(ref[1], got[1]))
    print(f"{quant} store TP=2 vs one process: max |prefill logit diff| = {diff:.3e}")
    assert diff < 0.05
    for a, t_ref, t_got in zip(ref[1], ref[0], got[0]):  # the first token agrees unless the top two are that close
        top = a[0].topk(2).values
        assert t_ref[0] == t_got[0] or (top[0] - top[1]).item() < 2 * diff


def test_tp3_on_the_embedded_gguf_keeps_its_linears_packed_and_its_table_dense(engines):
    """The embedded default model (SmolLM2-135M, a Q4_1 / Q8_0 GGUF) over three ranks: each rank keeps its slices
    of the packed Linear weights packed (GGUF blocks load as group-32 int4 / int8: 576 / 3 columns tile them) while
    its vocabulary slice of the packed table is read dense (a rank's lookup reads dense rows); the greedy answer
    equals one process's."""
    ask = ["The capital of France is"]
    sp = SamplingParams(temperature=0, max_tokens=6)
    one = LLM(None, dtype="float32", max_num_seqs=2, max_model_len=256)
    want = one.generate(ask, sp)[0].outputs[0].token_ids
    one.close()
    tp = engines(None, tensor_parallel_size=3, max_num_seqs=2, max_model_len=256)
    model = tp.engine.runner.model.model
    layer = model.layers[0]
    assert not model.embed_tokens.kernels and model.embed_tokens.weight.dim() == 2
    assert layer.self_attn.o_proj.kernels and layer.mlp.down_proj.kernels and layer.mlp.gate_up_proj.kernels
    got = tp.generate(ask, sp)[0].outputs[0].token_ids
    print(f"TP=3 on the embedded GGUF: {got} against one process's {want}")
    assert got == want


def test_tp2_tied_replicated_kv_padded_vocab_qkv_bias(tmp_path_factory, engines):
    """Qwen2 (qkv bias), tied embeddings, 1 KV head (replicated on both ranks), a vocabulary of 251 (the
    second rank's table shard is padded)."""
    path = build(tmp_path_factory, "qwen2", "Qwen2Config", "Qwen2ForCausalLM", vocab_size=251, num_key_value_heads=1,
                 tie_word_embeddings=True)
    ps = prompts([9, 30, 2], vocab=251)
    ref = run(LLM(path, dtype="float32"), ps, 10)
    tp = engines(path, tensor_parallel_size=2)
    compare("qwen2 tied, replicated KV, padded vocab, TP=2", ref, run(tp, ps, 10))


def test_sharded_weights_are_this_ranks_slice(llama_tp):
    """Rank 0 holds the first half of each split: its q rows, its half of the MLP, its vocabulary rows."""
    from safetensors import safe_open

    model = llama_tp.engine.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with safe_open(os.path.join(llama_tp.engine.config.model, "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        emb = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(attn.qkv_proj.weight[:32], q[:32])  # 2 of 4 heads x 16
    assert torch.equal(mlp.down_proj.weight, down[:, :48])  # columns of intermediate 0..47
    assert torch.equal(model.model.embed_tokens.weight, emb[:128])


def test_refused_before_any_process_starts(llama):
    with pytest.raises(ConfigError, match="not divisible by tensor_parallel_size 3"):
        LLM(llama, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="2 layers cannot be split into 3 pipeline stages"):
        LLM(llama, pipeline_parallel_size=3)


# -- pipeline parallelism ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_equal_one_process(llama, engines, tp):
    """PP=2 (one layer per stage) and TP=2 x PP=2 (4 processes), batched with preemption."""
    ps = prompts([37, 5, 60, 1, 23, 48], seed=3)
    alone = LLM(llama, dtype="float32", max_num_seqs=1, enable_prefix_caching=False)
    ref = [run(alone, [p], 8) for p in ps]
    llm = engines(llama, pipeline_parallel_size=2, tensor_parallel_size=tp, **SMALL_POOL)
    assert list(llm.engine.runner.layers) == [0] and llm.engine.runner.kv_cache.k.shape[0] == 1  # stage 0's own
    got = run(llm, ps, 8)
    assert llm.engine.scheduler.num_preemptions > 0
    compare(f"llama TP={tp} x PP=2 batched (preempted) vs alone",
            ([t for r in ref for t in r[0]], [r[1][0] for r in ref]), got)
    # prompt logprobs: rows of several micro-batches come back in the order the engine asked for them
    lp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    want = [o.prompt_logprobs for o in alone.generate(ps[:3], lp)] if tp == 1 else None
    if want:
        got_lp = [o.prompt_logprobs for o in llm.generate(ps[:3], lp)]
        for w, g_ in zip(want, got_lp):
            assert [sorted(d) if d else d for d in w] == [sorted(d) if d else d for d in g_]
            assert max(abs(w[i][t] - g_[i][t]) for i in range(1, len(w)) for t in w[i]) < TOL
    llm.engine.close()


def test_pipeline_stage_reads_its_own_int8_kv_scales(llama, engines):
    """A stage's KV cache holds its layers only (global layer index -> its own row), scales included."""
    ps = prompts([30, 4, 17], seed=4)
    ref = run(LLM(llama, dtype="float32", kv_cache_dtype="int8"), ps, 8)
    llm = engines(llama, pipeline_parallel_size=2, kv_cache_dtype="int8")
    compare("llama PP=2, int8 KV cache", ref, run(llm, ps, 8))
    llm.engine.close()


# -- MoE: experts sharded by intermediate features (TP) or whole experts (EP) -------------------------------

MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("family", list(MOE))
def test_moe_tp2_and_ep2_equal_one_process(family, tmp_path_factory, engines):
    cfg, cls, extra = MOE[family]
    path = build(tmp_path_factory, family, cfg, cls, **extra)
    ps = prompts([21, 4, 33])
    ref = run(LLM(path, dtype="float32"), ps, 8)
    tp = engines(path, tensor_parallel_size=2)
    compare(f"{family} TP=2 (expert intermediate split)", ref, run(tp, ps, 8))
    tp.engine.close()
    ep = engines(path, tensor_parallel_size=2, expert_parallel=True)
    bank = next(m for m in ep.engine.runner.model.modules() if type(m).__name__ == "ParallelExperts")
    assert bank.num_experts == 2 and bank.first_expert == 0  # rank 0 holds experts 0 and 1, whole
    compare(f"{family} EP=2 (whole experts per rank)", ref, run(ep, ps, 8))


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel=True),
                                dict(pipeline_parallel_size=2)])
def test_offload_composes_with_parallelism(kw, tmp_path_factory, engines):
    """Each rank places its shard under its own budget and rules (experts in host memory, one expert of
    layer 0 kept on the device): TP, EP and PP with offloaded experts equal one process. Under PP a rule
    for another stage's layers is that stage's business; a rule matching no layer at all still fails."""
    cfg, cls, extra = MOE["mixtral"]
    path = build(tmp_path_factory, "mixtral-offload", cfg, cls, **extra)
    ps = prompts([21, 4, 33])
    ref = run(LLM(path, dtype="float32"), ps, 8)
    rules = ("experts=cpu", "layers.0.experts.0=gpu")
    llm = engines(path, place=rules, gpu_memory_budget="1GiB", **kw)
    compare(f"mixtral offloaded experts {kw}", ref, run(llm, ps, 8))
    llm.engine.close()
    if "pipeline_parallel_size" in kw:
        with pytest.raises(Exception, match="matches no tensor group"):
            engines(path, place=("layers.7=cpu",), gpu_memory_budget="1GiB", **kw)


# -- Yuan 2.0: LF filter and attention router replicated per rank, heads / MLP / experts sharded ---------------

YUAN = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def yuan_dirs(tmp_path_factory):
    """The golden checkpoints' config.json + model.safetensors (their folders also hold golden.safetensors)."""
    from safetensors.torch import load_file

    out = {}
    for name in ("yuan2-tiny", "yuan2-m32-tiny"):
        d = tmp_path_factory.mktemp(name)
        for f in ("config.json", "model.safetensors"):
            os.symlink(os.path.join(YUAN, name, f), d / f)
        out[name] = (str(d), load_file(os.path.join(YUAN, name, "golden.safetensors")))
    return out


@pytest.mark.parametrize("name,kw", [
    ("yuan2-tiny", dict(tensor_parallel_size=2)),
    ("yuan2-m32-tiny", dict(tensor_parallel_size=2)),
    ("yuan2-m32-tiny", dict(tensor_parallel_size=2, expert_parallel=True)),
    ("yuan2-m32-tiny", dict(pipeline_parallel_size=2)),
], ids=["dense-tp2", "m32-tp2", "m32-ep2", "m32-pp2"])
def test_yuan_parallel_matches_golden_batched_with_preemption(name, kw, yuan_dirs, engines):
    """The golden prompt batched with three others, 8-token chunks and a pool small enough to preempt: its
    greedy ids and logits equal the reference HF code's (golden), the others' tokens equal one process's."""
    path, g = yuan_dirs[name]
    opts = {"rope_dtype": "bfloat16"} if "m32" in name else {}
    gen = torch.Generator().manual_seed(11)
    ps = [g["input_ids"][0].tolist()] + [torch.randint(0, 380, (n,), generator=gen).tolist() for n in (13, 3, 7)]
    steps = len(g["greedy_ids"])
    one = LLM(path, dtype="float32", max_num_seqs=4, model_overrides=opts)
    ref_tok, _ = run(one, ps, steps)
    llm = engines(path, max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_kv_blocks=14,
                  model_overrides=opts, **kw)
    tok, logits = run(llm, ps, steps)
    assert llm.engine.scheduler.num_preemptions > 0
    diff = (logits[0] - g["decode_logits"]).abs().max().item()
    print(f"{name} {kw}: batched + preempted, max |logit diff| vs golden = {diff:.3e}")
    assert tok[0] == g["greedy_ids"].tolist() and diff < TOL
    assert tok == ref_tok
    llm.engine.close()


# -- failures -------------------------------------------------------------------------------------------------


def test_killed_worker_fails_the_step_naming_the_rank(llama, engines):
    llm = engines(llama, tensor_parallel_size=2)
    run(llm, prompts([5]), 2)
    worker = llm.engine.runner.procs[1]
    worker.kill()
    t0 = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        run(llm, prompts([6]), 2)
    print(f"killed worker reported after {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerLostError):  # and stays failed
        llm.engine.check_health()


def test_hung_worker_fails_within_the_timeout(llama, engines):
    llm = engines(llama, tensor_parallel_size=2, parallel_timeout=3.0)
    run(llm, prompts([5]), 2)
    worker = llm.engine.runner.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerLostError, match=r"rank\(s\) \[1\] stopped answering"):
            run(llm, prompts([6]), 2)
    finally:
        if worker.exitcode is None:
            os.kill(worker.pid, signal.SIGCONT)
    took = time.monotonic() - t0
    print(f"hung worker reported after {took:.2f} s (timeout 3 s)")
    assert took < 15
    worker.join(5)
    assert worker.exitcode is not None, "the hung worker was not stopped"


def test_rank0_killed_leaves_no_worker(llama, tmp_path):
    """Also: a spawned worker logs at rank 0's level (INFO here), not a fixed WARNING."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import logging, sys, time\n"
        "from ferrylm import LLM\n"
        "if __name__ == '__main__':\n"
        "    logging.basicConfig(level=logging.INFO)\n"
        f"    llm = LLM({llama!r}, tensor_parallel_size=2)\n"
        "    print(*[p.pid for p in llm.engine.runner.procs.values()], flush=True)\n"
        "    time.sleep(600)\n")
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=f, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pid = int(proc.stdout.readline())
        assert psutil.pid_exists(pid)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived rank 0 by 10 s")
    assert "INFO rank1 " in err.read_text(), err.read_text()[-2000:]  # rank 1's placement / KV cache lines


# -- the server ------------------------------------------------------------------------------------------------


def test_server_tp2_answers_openai_then_reports_a_lost_worker(llama, llama_tp):
    openai = pytest.importorskip("openai")
    from serving import Server

    texts = ["hello parallel world", "abc"]
    single = LLM(llama, dtype="float32")
    want = [o.outputs[0].text for o in single.generate(texts, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True))]
    server = Server(["--model", llama, "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32"])
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for text, w in zip(texts, want):
            r = client.completions.create(model=llama, prompt=text, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == w  # greedy: the single-process engine's text
            assert r.usage.completion_tokens == 6
        workers = [c for c in psutil.Process(server.proc.pid).children(recursive=True)
                   if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1
        workers[0].kill()
        t0 = time.monotonic()
        import httpx

        while True:
            h = httpx.get(server.url + "/health", timeout=5)
            if h.status_code == 503:
                break
            assert time.monotonic() - t0 < 15, "still healthy 15 s after the worker died"
            time.sleep(0.2)
        print(f"/health unhealthy {time.monotonic() - t0:.2f} s after the worker was killed: {h.json()}")
        assert "rank 1" in h.json()["error"]
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=llama, prompt=texts[0], max_tokens=2)
        assert e.value.status_code == 503
    finally:
        assert server.stop() == 0
    assert not any(psutil.pid_exists(w.pid) and w.status() != psutil.STATUS_ZOMBIE for w in workers)


# -- torchrun, topology -----------------------------------------------------------------------------------------


def test_torchrun_joins_its_processes_instead_of_spawning(llama, tmp_path):
    want = LLM(llama, dtype="float32").generate("hi there", SamplingParams(temperature=0, max_tokens=5,
                                                                           ignore_eos=True))[0].outputs[0].text
    port = 29000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "ferrylm", "generate", "--model", llama, "--tensor-parallel-size", "2", "--dtype", "float32",
           "--max-tokens", "5", "hi there"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert want in r.stdout  # rank 0 printed the single-process engine's greedy text; rank 1 printed nothing
    assert r.stdout.count(want) == 1


def test_tp_groups_auto_keeps_each_group_on_one_socket():
    from ferrylm.parallel.topology import GPU, plan_groups

    # 8 PCIe GPUs, even ones on socket 0 (two switches), odd ones on socket 1, as some BIOSes number them
    gpus = [GPU(i, i % 2, ("0000:00:01.0", f"0000:1{i % 2}:00.0", f"0000:2{i % 4}:00.0")) for i in range(8)]
    order, why = plan_groups(gpus, tp=4, pp=2)
    assert set(order[:4]) == {0, 2, 4, 6} and set(order[4:]) == {1, 3, 5, 7}
    assert order[:2] == [0, 4]  # and the GPUs behind one switch next to each other
    assert all("crosses" not in w and "cross the CPU socket" not in w for w in why), why
    assert "NUMA node 0" in why[0] and "NUMA node 1" in why[1]
    order, why = plan_groups(gpus, tp=2, pp=4)  # pairs under one switch
    assert order[:2] == [0, 4] and "under PCI bridge 0000:20:00.0" in why[0]
    _, why = plan_groups(gpus, tp=8, pp=1)
    assert any("cross the CPU socket link" in w for w in why)
    with pytest.raises(ConfigError, match="16 ranks need 16 GPUs"):
        plan_groups(gpus, tp=8, pp=2)


def test_plan_predicts_a_ranks_kv_as_the_engine_caches_it(llama, llama_tp, tmp_path_factory):
    """`ferry plan --tensor-parallel-size 2`: per-rank KV bytes per token as the TP engine allocates them,
    including one replicated KV head per rank when the model has fewer KV heads than ranks."""
    from ferrylm.plan.planner import PlanOptions, make_plan

    def plan_kv(path, tp, pp=1):
        p = make_plan(PlanOptions(path, gpu="4xH200", host="1xXeon-8480C,1TB", dtype="float32", tp=tp, pp=pp,
                                  max_model_len=256), advise=False)
        return pytest.approx(p.per_gpu["kv"] / p.per_gpu["kv_tokens"], rel=1e-4)  # the pool is whole blocks

    engine_kv = llama_tp.engine.runner._kv_bytes_per_block() / llama_tp.engine.runner.block_size
    assert plan_kv(llama, 2) == engine_kv  # 2 KV heads over 2 ranks: half
    assert plan_kv(llama, 2, pp=2) == engine_kv / 2  # and one of the two layers
    assert plan_kv(llama, 1) == 2 * engine_kv
    one_kv = build(tmp_path_factory, "llama-1kv", "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1)
    assert plan_kv(one_kv, 2) == plan_kv(one_kv, 1).expected  # replicated, not halved


# -- on GPUs (NCCL): skipped where fewer than 2 (CI); the lead's check on a multi-GPU host ------------------


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                dict(tensor_parallel_size=2, expert_parallel=True)], ids=["tp2", "pp2", "ep2"])
def test_cuda_nccl_equals_one_gpu(kw, tmp_path_factory, engines):
    """NCCL ranks on 2 GPUs against one GPU, fp32 (Mixtral: attention, MLP experts, vocabulary all sharded)."""
    cfg, cls, extra = MOE["mixtral"]
    path = build(tmp_path_factory, "mixtral-cuda", cfg, cls, **extra)
    ps = prompts([37, 5, 60, 1, 23, 48], seed=5)
    ref = run(LLM(path, dtype="float32", device="cuda", enforce_eager=True, **SMALL_POOL), ps, 8)
    llm = engines(path, device="cuda", **SMALL_POOL, **kw)
    compare(f"mixtral {kw} on 2 GPUs (NCCL)", ref, run(llm, ps, 8))
    llm.engine.close()
