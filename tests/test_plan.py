"""`ferry plan`: the memory model against the engine's real allocations, the catalog against published
parameter counts, the verdicts and the placement, the VRAM-guide arithmetic, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ferrylm.errors import ConfigError
from ferrylm.plan import catalog, hardware
from ferrylm.plan.memory import KINDS, WeightFormat, analytical_groups, meta_model, summarize, tensor_groups
from ferrylm.plan.placement import distinct_experts, place
from ferrylm.plan.planner import PlanOptions, make_plan

DATA = os.path.join(os.path.dirname(__file__), "data")
HOST = "2xXeon-8480C,1TB"


def _yuan_dir(tmp_path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    for f in ("config.json", "model.safetensors"):  # not golden.safetensors: a source reads every file
        os.symlink(os.path.join(DATA, name, f), d / f)
    return str(d)


@pytest.mark.parametrize("kind", ["llama", "yuan2-tiny", "yuan2-m32-tiny"])
def test_plan_memory_equals_engine_allocation(kind, tiny_llama, tmp_path):
    """Weights, KV pool and per-sequence state as the plan predicts them = the bytes the engine holds after
    loading (exact: both count the same module and call the same KV sizing function)."""
    from ferrylm import LLM

    path = tiny_llama if kind == "llama" else _yuan_dir(tmp_path, kind)
    kv_gb, seqs = 0.01, 3
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=kv_gb, max_num_seqs=seqs, max_model_len=128)
    runner = llm.engine.runner
    params = {id(p): p.numel() * p.element_size() for p in runner.model.parameters()}  # tied: once
    got = {"weights": sum(params.values()), "kv": runner.kv_cache.nbytes,
           "state": runner.state_pool.nbytes if runner.state_pool is not None else 0}
    plan = make_plan(PlanOptions(path, gpu="1xH200", host=HOST, dtype="float32", kv_cache_memory_gb=kv_gb,
                                 max_num_seqs=seqs, max_model_len=128))
    want = {k: plan.per_gpu[k] for k in got}
    total_got, total_want = sum(got.values()), sum(want.values())
    print(f"{kind}: engine {got}, plan {want}, total rel diff {abs(total_want - total_got) / total_got:.2e}")
    assert want == got
    assert plan.per_gpu["kv_tokens"] == runner.kv_cache.num_blocks * runner.kv_cache.block_size
    assert plan.verdict == "fits"
    if kind == "llama":  # the CPU default size (no kv_cache_memory_gb) by the shared rule
        from ferrylm.plan.memory import kv_bytes_per_block, kv_pool_blocks

        auto = LLM(path, dtype="float32", max_num_seqs=seqs, max_model_len=128).engine.runner.kv_cache
        per_block = kv_bytes_per_block(llm.engine.model_config, auto.block_size, "float32")
        assert auto.num_blocks == kv_pool_blocks(per_block, max_num_seqs=seqs, max_model_len=128,
                                                 block_size=auto.block_size)


@pytest.mark.parametrize("name", sorted(catalog.CATALOG))
def test_catalog_counts_match_published_totals(name):
    p = make_plan(PlanOptions(name, gpu="8xH200", host=HOST, max_model_len=4096))
    total, active = catalog.PUBLISHED_PARAMS[name]
    print(f"{name}: {p.params_total / 1e9:.2f}B ({p.params_total / total - 1:+.2%}), "
          f"active {p.params_active / 1e9:.2f}B ({p.params_active / active - 1:+.2%}), from {p.counted_from}")
    assert abs(p.params_total / total - 1) < 0.01
    assert abs(p.params_active / active - 1) < 0.02
    assert p.counted_from == ("config" if name == "DeepSeek-V3" else "model")


def test_tensor_groups_cover_every_parameter_once():
    for name in ("Mixtral-8x7B", "Yuan2-M32", "Qwen3-30B-A3B", "Llama-3-8B"):
        model = meta_model(catalog.CATALOG[name])
        groups = tensor_groups(model)
        unique = {id(p): p for p in model.parameters()}
        assert sum(g.nbytes for g in groups) == sum(p.numel() * p.element_size() for p in unique.values()), name
        assert set(summarize(groups)) <= set(KINDS)
        experts = [g for g in groups if g.kind == "experts"]
        if experts:  # one group per (layer, expert), all the same size
            E = len({g.expert for g in experts})
            assert len(experts) == E * len({g.layer for g in experts}) and len({g.nbytes for g in experts}) == 1
    yuan = tensor_groups(meta_model(catalog.CATALOG["Yuan2-2B"]))
    assert "embed" not in summarize(yuan) and summarize(yuan)["lm_head"] == 135040 * 2048 * 2  # tied: one tensor


def test_quantized_weights_bytes():
    fmt = WeightFormat("bfloat16", "int8")
    assert fmt.param_bytes("model.layers.0.self_attn.o_proj.weight", (4096, 4096)) == 4096 * 4096 + 4 * 4096
    assert fmt.param_bytes("model.embed_tokens.weight", (1000, 64)) == 1000 * 64 * 2  # stays high precision
    assert WeightFormat("bfloat16", "nf4").param_bytes("x.weight", (128, 64)) == 128 * 64 // 2 + 4 * 128
    dense = summarize(tensor_groups(meta_model(catalog.CATALOG["Llama-3-8B"]), WeightFormat("bfloat16")))
    q = summarize(tensor_groups(meta_model(catalog.CATALOG["Llama-3-8B"]), WeightFormat("bfloat16", "nf4")))
    assert q["embed"] == dense["embed"] and q["mlp"] / dense["mlp"] == pytest.approx(4.5 / 16)  # 4 bits + an fp32 absmax per 64


def test_vram_guide_qwen2_72b_arithmetic():
    """The Qwen2-72B VRAM guide's table, recomputed: 8 KV heads -> 320 KiB of bf16 KV per token, so
    max_seq_len 2048 x batch 4 needs 2.5 GiB of KV (a 64-head MHA reading would claim 8x that)."""
    p = make_plan(PlanOptions("Qwen2-72B", gpu="1xA800-80G-PCIe", host=HOST, dtype="float16", max_model_len=2048,
                              max_num_seqs=4, prompt_len=1024, output_len=1024))
    assert p.per_gpu["kv_bytes_per_token"] == 320 * 1024
    assert 4 * 2048 * p.per_gpu["kv_bytes_per_token"] == int(2.5 * 2**30)
    assert abs(sum(p.weights_bytes.values()) / 145.4e9 - 1) < 0.001  # FP16 weights: 145.4 GB = 135.4 GiB
    assert p.verdict == "offload"  # one 80 GB card cannot hold FP16 weights
    p4 = make_plan(PlanOptions("Qwen2-72B", gpu="4xA800-80G-PCIe", host=HOST, dtype="float16", tp=4,
                               max_model_len=2048, max_num_seqs=4))
    assert p4.verdict == "fits" and p4.per_gpu["kv_tokens"] // 2048 > 100  # batch per 80 GB rank at 2048 tokens


def test_verdicts_and_advice():
    small = make_plan(PlanOptions("Llama-3-8B", gpu="1xH200", host=HOST))
    assert small.verdict == "fits" and any("offload unnecessary" in n for n in small.notes)
    assert small.speed["decode_batch1"]["binding"] in ("hbm", "launch")
    forced = make_plan(PlanOptions("Llama-3-8B", gpu="1xH200", host=HOST, weight_budget_gb=8))
    assert forced.verdict == "offload" and any("costs decode speed for nothing" in n for n in forced.notes)
    assert forced.speed["decode_batch1"]["tok_s"] < small.speed["decode_batch1"]["tok_s"] / 5
    moe = make_plan(PlanOptions("Qwen3-235B-A22B", gpu="1xH200", host=HOST, max_model_len=8192, max_num_seqs=8))
    assert moe.verdict == "offload" and moe.placement["host_groups"] == ["experts"]
    assert moe.placement["pcie_bytes_per_decode_token"] > 0 and moe.speed["decode_batch1"]["binding"] == "pcie"
    huge = make_plan(PlanOptions("DeepSeek-V3", gpu="1xRTX-4090", host="1xEPYC-9654,256GB", max_model_len=4096))
    assert huge.verdict == "cannot" and any("host memory" in n for n in huge.notes)
    assert any("quantize" in n for n in huge.notes) and any("no model class" in n for n in huge.notes)


def test_placement_order_and_expert_spread():
    groups = tensor_groups(meta_model(catalog.CATALOG["Mixtral-8x7B"]), WeightFormat("bfloat16"))
    dense = sum(g.nbytes for g in groups if g.kind not in ("experts", "embed"))
    expert = next(g.nbytes for g in groups if g.kind == "experts")
    pl = place(groups, dense + 3 * 32 * expert + 1)  # room for 3 experts in each of the 32 layers
    assert {g.kind for g in pl.host} == {"experts", "embed"}
    per_layer = {}
    for g in pl.gpu:
        if g.kind == "experts":
            per_layer[g.layer] = per_layer.get(g.layer, 0) + 1
    assert set(per_layer.values()) == {3} and len(per_layer) == 32
    assert pl.expert_resident_share() == 3 / 8
    d = distinct_experts(8, 2, 1)
    assert d == 2 and abs(pl.pcie_bytes_per_step(d) - 32 * 2 * 5 / 8 * expert) < 1
    assert distinct_experts(8, 2, 1000) == pytest.approx(8)


def test_hardware_specs():
    n, gpu = hardware.parse_gpu("4xA800-80G-PCIe")
    assert n == 4 and gpu.memory_bytes == 80 * 2**30 and not gpu.fp8 and gpu.h2d_gbs == 25
    host = hardware.parse_host(HOST)
    assert host.sockets == 2 and host.memory_bytes == 1e12 and host.bandwidth_per_node_gbs == pytest.approx(307.2)
    for bad in ("3xB999", "0xH200"):
        with pytest.raises(ConfigError, match="GPU|count"):
            hardware.parse_gpu(bad)
    with pytest.raises(ConfigError, match="memory"):
        hardware.parse_host("1xEPYC-9654,lots")
    with pytest.raises(ConfigError, match="catalog"):
        make_plan(PlanOptions("NoSuchModel-7B"))
    assert catalog.lookup("Qwen/Qwen2-72B-Instruct")[0] == "Qwen2-72B"
    assert catalog.lookup("yuan2.0-m32")[0] == "Yuan2-M32"


def test_deepseek_v3_analytical_count():
    groups = analytical_groups(catalog.CATALOG["DeepSeek-V3"], WeightFormat("bfloat16"))
    kinds = summarize(groups)
    assert len([g for g in groups if g.kind == "experts"]) == 256 * (61 - 3)
    assert kinds["mlp"] == 3 * 3 * 7168 * 18432 * 2  # three dense layers


def _ferry(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ferrylm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_plan_json_and_errors(capsys):
    r = _ferry("plan", "Qwen2-72B", "--gpu", "4xA800-80G-PCIe", "--host", HOST, "--tp", "4", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "fits" and d["per_gpu"]["kv_bytes_per_token"] == 327680 and d["options"]["tp"] == 4
    from ferrylm.cli import main  # the same entry point, in this process

    assert main(["plan", "Qwen2-72B", "--gpu", "2xB999"]) == 2
    assert "unknown GPU 'B999'" in capsys.readouterr().err
    assert main(["plan", "Mixtral-8x7B", "--gpu", "1xA800-80G-PCIe", "--host", HOST]) == 0
    out = capsys.readouterr().out
    assert "needs offload" in out and "decode, batch 1" in out and "experts" in out


def test_cli_plan_check_on_cpu(tmp_path, capsys):
    """`--check` runs the engine with the planned settings: on the CPU the byte counts are compared."""
    from ferrylm.cli import main

    path = _yuan_dir(tmp_path, "yuan2-m32-tiny")
    assert main(["plan", path, "--check", "--device", "cpu", "--dtype", "float32", "--host", HOST,
                 "--max-model-len", "64", "--max-num-seqs", "2", "--kv-cache-memory-gb", "0.005",
                 "--prompt-len", "32", "--output-len", "8", "--json"]) == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)["check"]}
    assert set(rows) == {"weights", "kv", "kv_tokens"}
    for r in rows.values():
        print(r)
        assert r["within"] and r["rel_error"] == 0
