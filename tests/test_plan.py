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
from ferrylm.offload.placement import KINDS, group_tensors
from ferrylm.plan.memory import WeightFormat, analytical_groups, meta_model, param_count, summarize, weight_groups
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


@pytest.mark.parametrize("kind,budget_share", [("llama", None), ("yuan2-m32-tiny", None), ("yuan2-m32-tiny", 0.5)])
def test_planner_parts_reproduce_the_engine_decision(kind, budget_share, tiny_llama, tmp_path):
    """The plan's building blocks (groups of the module on meta, `offload.memory.size_memory`) give the
    engine's own placement and KV bytes, resident and under a budget that forces offload."""
    from ferrylm import LLM
    from ferrylm.config import CacheConfig, ModelConfig, OffloadConfig, SchedulerConfig
    from ferrylm.offload.memory import size_memory
    from ferrylm.plan.memory import kv_bytes_per_block

    path = tiny_llama if kind == "llama" else _yuan_dir(tmp_path, kind)
    _, cfg = catalog.resolve_model(path)
    mc = ModelConfig.from_hf(cfg)
    groups = weight_groups(meta_model(mc, "float32"))
    budget = None
    if budget_share:
        budget = int(sum(g.nbytes for g in groups) * budget_share) + 8 * kv_bytes_per_block(mc, 16, "float32")
    llm = LLM(path, dtype="float32", max_num_seqs=3, max_model_len=64, gpu_memory_budget=budget)
    runner = llm.engine.runner
    oc = OffloadConfig(gpu_memory_budget=budget)
    placement, kv = size_memory(groups, kv_bytes_per_block(mc, 16, "float32"), 64, CacheConfig(),
                                SchedulerConfig(max_num_seqs=3, max_model_len=64), oc, budget, 0, on_cpu=True)
    assert placement.tier == runner.placement.tier and placement.fully_resident == (budget is None)
    assert placement.device_bytes() == runner.placement.device_bytes()
    assert (kv // kv_bytes_per_block(mc, 16, "float32")) == runner.kv_cache.num_blocks
    print(f"{kind} budget {budget}: {sum(t == 'cpu' for t in placement.tier.values())} groups in host memory, "
          f"KV {runner.kv_cache.num_blocks} blocks, same as the engine")


@pytest.mark.parametrize("name", sorted(catalog.CATALOG))
def test_catalog_counts_match_published_totals(name):
    p = make_plan(PlanOptions(name, gpu="8xH200", host=HOST, max_model_len=4096))
    total, active = catalog.PUBLISHED_PARAMS[name]
    print(f"{name}: {p.params_total / 1e9:.2f}B ({p.params_total / total - 1:+.2%}), "
          f"active {p.params_active / 1e9:.2f}B ({p.params_active / active - 1:+.2%}), from {p.counted_from}")
    assert abs(p.params_total / total - 1) < 0.01
    assert abs(p.params_active / active - 1) < 0.02
    assert p.counted_from == "model"


def test_weight_groups_are_the_engines_groups():
    for name in ("Mixtral-8x7B", "Yuan2-M32", "Qwen3-30B-A3B", "Llama-3-8B"):
        model = meta_model(catalog.CATALOG[name])
        groups = weight_groups(model)
        assert groups == group_tensors(model)
        assert sum(g.nbytes for g in groups) == 2 * param_count(model).total, name  # bf16, every tensor once
        assert set(summarize(groups)) <= set(KINDS)
    yuan = weight_groups(meta_model(catalog.CATALOG["Yuan2-2B"]))
    assert "embed" not in summarize(yuan) and summarize(yuan)["lm_head"] == 135040 * 2048 * 2  # tied: one tensor


def test_quantized_weights_bytes():
    fmt = WeightFormat("bfloat16", "int8")
    assert fmt.param_bytes("model.layers.0.self_attn.o_proj.weight", (4096, 4096)) == 4096 * 4096 + 4 * 4096
    assert fmt.param_bytes("model.embed_tokens.weight", (1000, 64)) == 1000 * 64 * 2  # stays high precision
    assert WeightFormat("bfloat16", "nf4").param_bytes("x.weight", (128, 64)) == 128 * 64 // 2 + 4 * 128
    dense = summarize(weight_groups(meta_model(catalog.CATALOG["Llama-3-8B"]), WeightFormat("bfloat16")))
    q = summarize(weight_groups(meta_model(catalog.CATALOG["Llama-3-8B"]), WeightFormat("bfloat16", "nf4")))
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
    forced = make_plan(PlanOptions("Llama-3-8B", gpu="1xH200", host=HOST, gpu_memory_budget_gb=10))
    assert forced.verdict == "offload" and any("forces offload of a model that fits" in n for n in forced.notes)
    assert forced.speed["decode_batch1"]["tok_s"] < small.speed["decode_batch1"]["tok_s"] / 5
    moe = make_plan(PlanOptions("Qwen3-235B-A22B", gpu="1xH200", host=HOST, max_model_len=8192, max_num_seqs=8))
    assert moe.verdict == "offload" and "experts" in moe.placement["host_groups"]
    assert moe.placement["expert_slots"] >= 2  # the engine's cache slots for host-resident experts
    assert moe.placement["pcie_bytes_per_decode_token"] > 0 and moe.speed["decode_batch1"]["binding"] == "pcie"
    # the engine's default budget (at most 90% of free memory) offloads bf16 Qwen2-72B on an H200, whatever
    # --gpu-memory-utilization says; an explicit budget of 137 GiB holds it at 2048 tokens
    q72 = make_plan(PlanOptions("Qwen2-72B", gpu="1xH200", host=HOST, max_model_len=2048, max_num_seqs=4))
    assert q72.verdict == "offload" and any("--gpu-memory-budget 137GiB it fits" in n for n in q72.notes)
    assert make_plan(PlanOptions("Qwen2-72B", gpu="1xH200", host=HOST, max_model_len=2048, max_num_seqs=4,
                                 gpu_memory_utilization=0.99)).verdict == "offload"
    huge = make_plan(PlanOptions("DeepSeek-V3", gpu="1xRTX-4090", host="1xEPYC-9654,256GB", max_model_len=4096))
    assert huge.verdict == "cannot" and any("host memory" in n for n in huge.notes)
    assert any("quantize" in n for n in huge.notes)


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


def test_deepseek_v3_analytical_count_equals_the_module():
    cfg = catalog.CATALOG["DeepSeek-V3"]
    groups, count = analytical_groups(cfg, WeightFormat("bfloat16"))
    model = meta_model(cfg)
    assert count.total == param_count(model).total and count.active == param_count(model).active
    assert sum(g.nbytes for g in groups) == 2 * count.total
    assert len([g for g in groups if g.kind == "experts"]) == 256 * (61 - 3)
    assert summarize(groups)["mlp"] == 3 * 3 * 7168 * 18432 * 2  # three dense layers
    p = make_plan(PlanOptions("DeepSeek-V3", gpu="8xH200", host=HOST, tp=8, max_model_len=4096))
    assert p.per_gpu["kv_bytes_per_token"] == 61 * (512 + 64) * 2  # MLA: the latent and the rope key


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
