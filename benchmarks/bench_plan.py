"""`ferry plan` predictions against the engine, on the machine this runs on (the H200 for docs/benchmarks.md).

Each case builds a random-weight model of a real shape in memory (`RandomSource`, no disk), plans it for
`--gpu` (config.json written to a temp dir, so the planner reads it as a user's would) and runs the engine
with the planned settings (`ferrylm.plan.check`): weights and KV bytes, KV tokens, peak GPU memory, prefill
and decode tok/s at batch 1 and at the concurrency. Offloaded cases also record the routing of their runs (`ferry profile`'s
counts) and re-plan with it (`--routing FILE`: the predicted hit rate beside the measured one and the uniform
floor), and re-plan with the hit rate each decode run measured (`--expert-hit-rate`), which separates the
routing model from the bandwidth model. The warm-up step the CUDA engine measures before sizing its KV pool is
compared with the plan's estimate of it (`step_activations`). Cases on CUDA:
- dense: Llama-3-8B shape, 16 layers (~9 GB bf16), resident, CUDA graphs;
- moe: Mixtral-8x7B shape, 8 layers (~23.5 GB), resident, fused MoE graphed;
- moe-offload: Qwen3-30B-A3B shape, 16 layers (~20 GB) under `--gpu-memory-budget 4 GiB` (128 experts of
  9.4 MB: misses read in place at decode up to 64 tokens);
- moe-offload-nf4: Mixtral-8x7B shape, 8 layers, NF4 experts (packed, ~6.3 GB) under 5 GiB (99 MB experts:
  read in place only at one token, copied at 16);
- moe-nf4: the same NF4 Mixtral resident (its prefill past `fused_moe.graph_token_limit` tokens runs eagerly on
  `dequant_rows`; decode graphed on the NF4 decode kernel).
`--device cpu` (or no CUDA): a smoke run of the same script on tiny shapes (byte counts only; the offload
cases force experts to host memory with `--place experts=cpu`). Aims: weights +-1%, peak +-5%, decode +-20%.
Each case runs in a process of its own under a time limit (`--case-timeout`, and what is left of `--time-budget`),
so a case that fails, hangs or spoils the CUDA context costs only its own rows (an `error` row names it).
Writes benchmarks/results/plan-check-<date>.json; the last line printed is JSON.

    PYTHONPATH=. python benchmarks/bench_plan.py --gpu 1xH200   # on the H200: ~4-7 minutes, at most --time-budget
    PYTHONPATH=. python benchmarks/bench_plan.py --device cpu   # smoke, seconds
    PYTHONPATH=. python benchmarks/bench_plan.py --replay benchmarks/results/plan-check-2026-12-01.json
        # no GPU: today's plan for an earlier GPU run's cases (its measured H2D / host read rates), beside its figures
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

from results import write_results  # benchmarks/results.py

from ferrylm.plan.check import compare, engine_for, measure, predicted, record_routing, routing_rows
from ferrylm.plan.planner import PlanOptions, make_plan

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
             "rope_theta": 5e5, "max_position_embeddings": 8192, "tie_word_embeddings": False}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
           "tie_word_embeddings": False}
QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
             "tie_word_embeddings": False}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_local_experts": 4}

# case -> (config, layers, GiB budget or None, experts stored as, decode tokens per run)
CASES = {
    "dense": (LLAMA3_8B, 16, None, None, 64),
    "moe": (MIXTRAL, 8, None, None, 64),
    "moe-offload": (QWEN3_30B, 16, 4, None, 32),
    "moe-offload-nf4": (MIXTRAL, 8, 5, "nf4", 32),
    "moe-nf4": (MIXTRAL, 8, None, "nf4", 64),
    "moe-offload-bf16": (MIXTRAL, 8, 12, None, 32),  # dense banks on the copy road (session 37)
    "moe-pool-bf16": (MIXTRAL, 8, 4, None, 32),  # no room for 2 slots a layer: the shared slot pool (session 38)
}


def case_config(case: str, tiny: bool) -> tuple[dict, float | None, str | None, int]:
    base, layers, budget_gib, experts, tokens = CASES[case]
    cfg = {**base, "num_hidden_layers": layers}
    if tiny:  # the same families at toy sizes: a smoke run of the script on the CPU
        cfg.update({k: v for k, v in TINY.items() if k in cfg}, num_hidden_layers=2, max_position_embeddings=4096)
    return cfg, budget_gib, experts, tokens


def case_options(case: str, a, cuda: bool) -> tuple[dict, str, PlanOptions]:
    """(config, its temp dir, the plan's options) of one case, as the engine will be run with them."""
    cfg, budget_gib, experts, tokens = case_config(case, tiny=not cuda)
    d = tempfile.mkdtemp(prefix=f"ferry-plan-{case}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    # room for the prompt and its output (a 2048-token prompt needs more than the default 2048)
    max_len = max(2048, 1 << (a.prompt_len + tokens - 1).bit_length())
    opts = PlanOptions(os.path.join(d, "config.json"), gpu=a.gpu, host=a.host, max_model_len=max_len,
                       max_num_seqs=a.concurrency, prompt_len=a.prompt_len, output_len=tokens,
                       concurrency=a.concurrency, measure_bandwidth=cuda and not a.profile_h2d, experts=a.experts,
                       mapped_experts=not a.no_mapped_experts,
                       expert_quant=experts if cuda else None)  # the CPU engine dequantizes packed experts
    if budget_gib is not None and cuda:
        opts = replace(opts, gpu_memory_budget_gb=budget_gib * 2**30 / 1e9)
    elif budget_gib is not None:
        opts = replace(opts, place=("experts=cpu",))
    if not cuda:
        opts = replace(opts, dtype="float32", kv_cache_memory_gb=0.01, prompt_len=32, output_len=4)
    return cfg, d, opts


def replay(path: str, a) -> list[dict]:
    """The current plan for the CUDA cases of an earlier GPU run, on this machine (no GPU needed): planned with
    the pinned H2D and host read rates that run measured, its measured figures beside the new predictions."""
    from unittest import mock

    from ferrylm.plan import hardware

    with open(path) as f:
        old = json.load(f)
    gpu = old.get("gpu_profile") or old.get("gpu")  # files before session 24 name none: the H200
    if gpu and gpu.strip().lower() == "local":  # session 25's file names the card only in its note
        from ferrylm.hw.probe import profile_for

        prof = profile_for(old.get("machine_note", ""))
        if prof is None:
            raise SystemExit(f"{path}: ran with --gpu local and names no GPU this planner knows; pass its profile")
        gpu = f"1x{prof.name}"
    # plan for the GPU that run measured, with the engine options it ran (files before session 37 name none)
    a = argparse.Namespace(**{**vars(a), "gpu": gpu or a.gpu, "experts": old.get("experts", "auto"),
                              "no_mapped_experts": old.get("no_mapped_experts", False)})
    rows = []
    for case, info in old["cases"].items():
        if case not in CASES:
            continue
        opts = case_options(case, a, cuda=True)[2]
        with mock.patch.object(hardware, "measured_h2d_gbs", lambda index=0: info["h2d_gbs"]), \
                mock.patch.object(hardware, "measured_host_read_gbs", lambda: info["host_read_gbs"]):
            plan = make_plan(opts)
            now = predicted(plan, cuda=True)
            print(f"{case} prefill: {plan.speed['prefill_tok_s']:.1f} tok/s, binding {plan.speed['prefill_binding']}, "
                  f"parts ms { {p: round(v, 3) for p, v in plan.speed['prefill_parts_ms'].items()} }", flush=True)
            for key, hit in (info.get("hit_rate_measured") or {}).items():
                if hit is not None:  # the bandwidth model alone, at the hit rate the run saw
                    at = make_plan(replace(opts, expert_hit_rate=hit), advise=False).speed[key]
                    now[f"{key} @measured hit"] = at["tok_s"]
                    print(f"{case} {key} @measured hit {hit:.3f}: {at['tok_s']:.1f} tok/s, binding {at['binding']}, "
                          f"parts ms { {p: round(v, 3) for p, v in at['parts_ms'].items() if v} }", flush=True)
        for r in old["rows"]:
            if r.get("case") == case and r.get("metric") in now:
                rows.append(dict(case=case, metric=r["metric"], measured=r["measured"], predicted_then=r["predicted"],
                                 predicted_now=now[r["metric"]],
                                 rel_error_now=(now[r["metric"]] - r["measured"]) / r["measured"]))
        for key in ("decode_batch1", "decode_concurrent"):
            s = plan.speed[key]
            print(f"{case} {key}: {s['tok_s']:.1f} tok/s, binding {s['binding']}, hit {s['expert_hit_rate']}, "
                  f"parts ms { {p: round(v, 3) for p, v in s['parts_ms'].items() if v} }", flush=True)
    for r in rows:
        print(f"  {r['case']:12s} {r['metric']:18s} measured {r['measured']:>14,.1f}  then {r['predicted_then']:>14,.1f}"
              f"  now {r['predicted_now']:>14,.1f}  {r['rel_error_now']:+7.1%}", flush=True)
    return rows


def run_case(case: str, a, device: str) -> tuple[list[dict], dict]:
    from ferrylm.weights.random_source import RandomSource

    cuda = device == "cuda"
    cfg, d, opts = case_options(case, a, cuda)
    experts, tokens = CASES[case][3], CASES[case][4]  # the engine's expert format (the CPU one dequantizes)
    plan = make_plan(opts)
    t = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = engine_for(plan, RandomSource(cfg, dtype=getattr(torch, plan.options.dtype), expert_quant=experts), device)
    load_s = time.perf_counter() - t
    runner = llm.engine.runner
    cached = bool(runner.placed.caches)
    moe = record_routing(llm, cuda)
    got = measure(plan, llm, cuda, max_decode_tokens=tokens)
    rows = compare(predicted(plan, cuda), got)
    info = dict(verdict=plan.verdict, load_s=load_s, h2d_gbs=plan.speed["assumptions"]["h2d_gbs"],
                experts_path={k: plan.speed[k].get("experts_path") for k in ("decode_batch1", "decode_concurrent")},
                binding={k: plan.speed[k]["binding"] for k in ("decode_batch1", "decode_concurrent")},
                hit_rate_assumed=plan.speed["assumptions"].get("expert_hit_rate"),
                hit_rate_measured={k: got.get(f"hit_rate_{k}") for k in ("decode_batch1", "decode_concurrent")},
                offload_per_step={k: got.get(f"offload_{k}") for k in ("decode_batch1", "decode_concurrent")},
                settle={k: got.get(f"settle_{k}") for k in ("decode_batch1", "decode_concurrent")},  # hybrid's share
                concurrency=plan.speed["decode_concurrent"]["batch"],
                cpu_share_planned=plan.speed["assumptions"].get("cpu_share"),
                cpu_share_engine=runner.placed.cpu_share if cached else None,
                engine_calibration=runner.placed.calibration if cached else None,  # what set that share
                host_read_gbs=plan.speed["assumptions"].get("host_read_gbs"),
                kv_tokens_range=plan.per_gpu["kv_tokens_range"], kv_tokens_planned=plan.per_gpu["kv_tokens_planned"],
                step_activations_measured=runner.step_peak, step_activations_predicted=plan.per_gpu["step_activations"],
                activation_reserve=plan.per_gpu["activations"], budget=plan.per_gpu["budget"],
                engine_budget=runner._budget,  # the engine's own (from CUDA's total and free memory)
                cuda_total=torch.cuda.get_device_properties(0).total_memory if cuda else None,
                # per phase of the check: its peak allocation above the engine at rest (weights, KV, buffers)
                peak_phases=got.get("peak_phases"), peak_reserved=got.get("peak_reserved"),
                step_peaks=got.get("step_peaks"),  # the untimed runs' steps with the highest peaks, one per shape
                held_after=torch.cuda.memory_allocated() if cuda else None)
    if moe:  # the speeds and hit rates predicted from the routing these runs saw (this engine pinned nothing)
        more, seen = routing_rows(plan, llm, got, os.path.join(d, "routing.json"))
        rows += more
        info.update(seen)
    for r in rows:
        r["case"] = case
    llm.close()  # its device memory, host registrations and threads, now
    return rows, info


def print_case(case: str, got: list[dict], info: dict) -> None:
    print(f"\n{case} ({info['verdict']}, loaded in {info['load_s']:.0f} s, H2D {info['h2d_gbs']:.1f} GB/s, "
          f"hit rate assumed {info['hit_rate_assumed']}, measured {info['hit_rate_measured']}; host share "
          f"planned {info['cpu_share_planned']}, engine {info['cpu_share_engine']}):", flush=True)
    for key, st in (info.get("offload_per_step") or {}).items():
        if st:  # per decode step: misses, where they went, the host's work and the stream's wait for it
            print(f"  {key} per step: " + ", ".join(f"{k} {v:.3g}" for k, v in st.items()), flush=True)
    if info.get("peak_phases"):  # which phase of the check allocated the most above the engine at rest
        print("  peak per phase above the engine when the check began (it holds "
              f"{info['held_after'] / 2**30:.2f} GiB after it; budget {(info['budget'] or 0) / 2**30:.2f} GiB, "
              f"peak reserved {info['peak_reserved'] / 2**30:.2f} GiB): " + ", ".join(
                  f"{k} {v / 2**20:,.0f} MiB" for k, v in info["peak_phases"].items()), flush=True)
        for r in (info.get("step_peaks") or [])[:4]:
            print(f"    step {r['kind']} ({r['tokens']} tokens, {r['seqs']} seqs, {r['decodes']} decodes): peak "
                  f"{r['peak_over_base'] / 2**20:,.0f} MiB above, holds {r['held_over_base'] / 2**20:,.0f} MiB after",
                  flush=True)
    fmt = {"weights": 2**30, "kv": 2**30, "peak": 2**30, "step_activations": 2**20}
    for r in got:
        div = fmt.get(r["metric"], 1)
        unit = {2**30: " GiB", 2**20: " MiB"}.get(div, "")
        print(f"  {r['metric']:44s} predicted {r['predicted'] / div:>12,.2f}{unit}  measured "
              f"{r['measured'] / div:>12,.2f}{unit}  {r['rel_error']:+7.1%}  (aim +-{r['aim']:.0%}) "
              f"{'ok' if r['within'] else 'MISSED'}", flush=True)


def run_isolated(case: str, a, timeout: float) -> tuple[list[dict], dict | None]:
    """One case in a process of its own: its rows and info, or one error row (failed, killed, timed out)."""
    fd, out = tempfile.mkstemp(prefix=f"bench-plan-{case}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--one-case", case, "--case-result", out, "--gpu", a.gpu,
           "--host", a.host, "--device", a.device, "--prompt-len", str(a.prompt_len), "--concurrency",
           str(a.concurrency), "--experts", a.experts] + (["--profile-h2d"] if a.profile_h2d else []) \
        + (["--no-mapped-experts"] if a.no_mapped_experts else [])
    try:
        r = subprocess.run(cmd, timeout=timeout)
        with open(out) as f:
            done = json.load(f)
    except subprocess.TimeoutExpired:
        return [{"case": case, "error": f"timed out after {timeout:.0f} s"}], None
    except (OSError, ValueError):
        return [{"case": case, "error": f"the case's process exited with status {r.returncode} and no result"}], None
    finally:
        os.unlink(out)
    if "error" in done:
        return [{"case": case, "error": done["error"]}], None
    return done["rows"], done["info"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="1xH200", help="the GPU profile to plan for (the machine this runs on)")
    ap.add_argument("--host", default="local")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--profile-h2d", action="store_true",
                    help="plan with the profile's pinned H2D rate instead of measuring this machine's")
    ap.add_argument("--experts", default="auto", choices=("auto", "gpu", "cpu"),
                    help="where expert misses run (the engine's --experts; auto: hybrid decode)")
    ap.add_argument("--no-mapped-experts", action="store_true",
                    help="plan and run the engine's --no-mapped-experts (one-token steps copy misses in too)")
    ap.add_argument("--time-budget", type=float, default=330, help="seconds for all cases; later ones are skipped")
    ap.add_argument("--case-timeout", type=float, default=150, help="seconds one case may take")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/plan-check-<date>.json)")
    ap.add_argument("--one-case", default=None, help=argparse.SUPPRESS)  # internal: run one case, write its result
    ap.add_argument("--case-result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--replay", default=None, metavar="RESULTS",
                    help="re-plan the cases of an earlier GPU run's results JSON with today's plan (no engine run)")
    a = ap.parse_args()
    if a.replay:
        write_results("plan-replay", replay(a.replay, a), out=a.out, of=os.path.relpath(a.replay))
        return
    if a.one_case:
        try:
            got, info = run_case(a.one_case, a, a.device)
            done = {"rows": got, "info": info}
        except Exception as e:  # the parent reports it; the traceback goes to this process's stderr
            import traceback

            traceback.print_exc()
            done = {"error": repr(e)}
        with open(a.case_result, "w") as f:
            json.dump(done, f, default=str)
        return
    rows, cases, start = [], {}, time.perf_counter()
    for case in a.cases:
        left = a.time_budget - (time.perf_counter() - start)
        if left < 20:
            rows.append({"case": case, "error": f"skipped: the time budget ({a.time_budget:.0f} s) is spent"})
            continue
        got, info = run_isolated(case, a, min(a.case_timeout, left))
        rows += got
        if info is None:
            print(f"\n{case}: {got[0]['error']}", flush=True)
            continue
        cases[case] = info
        print_case(case, got, info)
    write_results("plan-check", rows, out=a.out, gpu=a.gpu, gpu_profile=gpu_profile(a), device=a.device, cases=cases,
                  experts=a.experts, no_mapped_experts=a.no_mapped_experts, seconds=time.perf_counter() - start)


def gpu_profile(a) -> str:
    """The data-sheet profile the run planned with: `--gpu` as given, or for `local` the one NVML's name matches
    (what `replay` plans with on a machine without that GPU)."""
    if a.gpu.strip().lower() != "local" or a.device != "cuda":
        return a.gpu
    from ferrylm.hw.probe import profile_for

    prof = profile_for(torch.cuda.get_device_name())
    return f"1x{prof.name}" if prof else a.gpu


if __name__ == "__main__":
    main()
