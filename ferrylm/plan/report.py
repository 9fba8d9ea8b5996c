"""A plan as text: rich tables for a person, one JSON object for a machine. Knows nothing about how the
figures were computed."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from ferrylm.plan.planner import Plan

_VERDICT = {"fits": "[green]fits resident[/]", "offload": "[yellow]needs offload[/]", "cannot": "[red]cannot run[/]"}


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render(plan: Plan, console: Console) -> None:
    o = plan.options
    console.print(f"[bold]{plan.model_name}[/] ({plan.architecture}, {plan.params_total / 1e9:.2f}B params, "
                  f"{plan.params_active / 1e9:.2f}B active) on {plan.gpus}x {plan.gpu}, host {plan.host}: "
                  f"{_VERDICT[plan.verdict]}")
    w = Table(title=f"weights, {o.dtype}{' ' + o.quant if o.quant else ''}")
    w.add_column("group")
    w.add_column("bytes", justify="right")
    for kind, n in plan.weights_bytes.items():
        w.add_row(kind, gib(n))
    w.add_row("[bold]total[/]", gib(sum(plan.weights_bytes.values())))
    console.print(w)
    g = plan.per_gpu
    which = (f"the heaviest of TP {o.tp} x PP {o.pp}" if g.get("stage") is None else
             f"TP {o.tp} x PP {o.pp}: stage {g['stage']}, where --place puts the most in host memory")
    m = Table(title=f"per GPU ({which})")
    m.add_column("item")
    m.add_column("bytes", justify="right")
    m.add_column("note")
    m.add_row("weights on GPU", gib(g["weights"]), f"of {gib(g['weights_all'])} this rank holds (incl. stream "
              "buffers and expert slots)")
    if g["held"] > g["weights"]:
        m.add_row("RoPE tables, cuBLAS workspace", gib(g["held"] - g["weights"]), "held from the load on")
    lo, hi = g["kv_tokens_range"]
    rank = "" if o.tp * o.pp == 1 else \
        f" a rank (the model's {g['kv_bytes_per_token_model'] / 1024:.1f} KiB over TP {o.tp} x PP {o.pp})"
    m.add_row("KV cache", gib(g["kv"]), f"{g['kv_tokens']:,} tokens x {g['kv_bytes_per_token'] / 1024:.1f} KiB{rank} "
              f"({o.block_size}-token blocks) after the engine's warm-up; {lo:,}-{hi:,} as the measured step "
              f"varies; planned {g['kv_tokens_planned']:,}")
    if g["state"]:
        m.add_row("sequence state", gib(g["state"]), f"{o.max_num_seqs} slots")
    m.add_row("activation reserve", gib(g["activations"]), f"{o.max_num_batched_tokens}-token steps (the engine's "
              f"upper estimate); warm-up step predicted {gib(g['step_activations'])}, leaving "
              f"{gib(g['warmup_activations'])} with the sampler{' and graph pools' if not o.enforce_eager else ''}")
    m.add_row("CUDA context", gib(g["cuda_context"]), "")
    m.add_row("[bold]peak[/]", gib(g["peak"]), f"of {gib(g['capacity'])}; engine budget {gib(g['budget'] or 0)}")
    console.print(m)
    if plan.verdict == "offload":
        p = plan.placement
        layers = p["streamed_layers"]
        console.print(f"placement (the engine's): {gib(p['gpu_bytes'])} resident, {gib(p['host_bytes'])} in host memory "
                      f"({', '.join(p['host_groups'])}); {len(layers)} layers streamed through "
                      f"{gib(p['stream_buffer_bytes'])} of buffers; "
                      + (f"{p['expert_slots']} expert cache slots per MoE layer; "
                         if p["resident_experts"] and p["expert_slots"] else "")
                      + (f"{p['shared_expert_slots']} expert slots shared by {len(p['pool_layers'])} MoE layers; "
                         if p.get("shared_expert_slots") else "")
                      + f"PCIe {gib(p['pcie_bytes_per_decode_token'])} per decode token at batch 1")
    s = plan.speed
    if s is None:
        console.print("speed: not predicted (it cannot run as planned; see below for what would)")
        for n in plan.notes:
            console.print(f"- {n}")
        return
    t = Table(title="predicted speed (roofline; see assumptions)")
    t.add_column("")
    t.add_column("tok/s", justify="right")
    t.add_column("step", justify="right")
    t.add_column("binds")
    rows = ("decode_batch1",) + (("decode_concurrent",) if s["decode_concurrent"]["batch"] > 1 else ())
    for key in rows:  # a workload of one sequence (or room for one) is the batch-1 row already
        d = s[key]
        path = "" if d.get("experts_path") in (None, "resident") else \
            f", experts {d['experts_path']} (hit {d['expert_hit_rate']:.2f})"
        t.add_row(f"decode, batch {d['batch']}", f"{d['tok_s']:,.1f}", f"{d['step_ms']:.2f} ms",
                  d["binding"] + path + (", graphs" if d.get("cuda_graphs") else ""))
    t.add_row(f"prefill ({s.get('prompt_len', o.prompt_len)}-token prompt)", f"{s['prefill_tok_s']:,.0f}", f"TTFT {s['ttft_s']:.3f} s",
              s["prefill_binding"])
    console.print(t)
    a = s["assumptions"]
    moe = (f", fused MoE {a['moe_hbm_eff']:.0%}+ of peak HBM" if a.get("moe_hbm_eff") else "")
    hit = (f"; experts: hit rate {a['expert_hit_rate']:.2f} at batch 1 ({a['expert_hit_rate_from']}), in place at "
           f"{a['inplace_eff']:.0%} of H2D up to {a['mapped_tokens']} token(s)" if a.get("expert_hit_rate") is not None
           and a.get("mapped_tokens") else f"; experts: hit rate {a['expert_hit_rate']:.2f} at batch 1 ({a['expert_hit_rate_from']})"
           if a.get("expert_hit_rate") is not None else "")
    dq = (f", packed experts decoded for prefill at {a['dequant_gbs']:.0f} GB/s" if a.get("dequant_gbs") else "")
    console.print(f"[dim]assumptions: {a['hbm_eff']:.0%} of peak HBM{moe}, {a['mfu']:.0%} MFU, {a['h2d_gbs']:.0f} GB/s "
                  f"pinned H2D, {a['launch_us_per_layer']:.0f} us launch per layer{dq}{hit}; counted from the "
                  f"{'engine model on meta' if plan.counted_from == 'model' else 'config (analytical)'}[/]")
    for n in plan.notes:
        console.print(f"- {n}")


def render_check(rows: list[dict], console: Console) -> None:
    t = Table(title="predicted vs measured (ferry plan --check)")
    for col in ("metric", "predicted", "measured", "error", "aim"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        fmt = gib if r["metric"] in ("weights", "kv", "peak", "step_activations") else (lambda v: f"{v:,.1f}")
        colour = "green" if r["within"] else "red"
        t.add_row(r["metric"], fmt(r["predicted"]), fmt(r["measured"]), f"[{colour}]{r['rel_error']:+.1%}[/]",
                  f"+-{r['aim']:.0%}")
    console.print(t)


def to_json(plan: Plan, check: list[dict] | None = None) -> str:
    d = plan.to_dict()
    if check is not None:
        d["check"] = check
    return json.dumps(d, sort_keys=True)
