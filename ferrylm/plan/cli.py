"""`ferry plan`: flags map 1:1 onto `PlanOptions` fields (defaults come from the dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from ferrylm.plan.planner import PlanOptions

_HELP = {
    "gpu": 'COUNTxNAME, e.g. "4xA800-80G-PCIe", or local (NVML: this machine\'s GPUs; COUNTxlocal: COUNT like its '
           'first)',
    "host": 'SOCKETSxCPU[,MEMORY], e.g. "2xXeon-8480C,1TB", or local (/proc, /sys)',
    "dtype": "the model's dtype as the engine runs it: auto (as on a GPU: the checkpoint's float16, else bfloat16), "
             "bfloat16, float16 or float32",
    "kv_cache_dtype": "auto (the model's dtype), fp8 or int8 (the engine's quantized cache)",
    "max_model_len": "context length, as the engine's --max-model-len (default: the model's)",
    "max_num_seqs": "sequences the engine schedules together, as its --max-num-seqs",
    "max_num_batched_tokens": "tokens in one engine step, as its --max-num-batched-tokens",
    "block_size": "tokens per KV block, as the engine's --block-size",
    "gpu_memory_utilization": "share of each GPU's memory to use when no budget is given (engine default 0.9)",
    "tp": "tensor-parallel ranks, as the engine's --tensor-parallel-size",
    "pp": "pipeline stages, as the engine's --pipeline-parallel-size",
    "prompt_len": "the workload's prompt tokens",
    "output_len": "the workload's generated tokens per sequence",
    "enforce_eager": "plan the engine's --enforce-eager (no CUDA graphs)",
    "quant": "int8 | fp8 | nf4 | int4 | q8_0 (a ferry store converted with --quant; int4 / nf4 experts stay packed)",
    "expert_quant": "the experts' scheme when it differs from --quant (e.g. nf4 experts, the rest bf16)",
    "group_size": "NF4 / int4 columns a scale covers, as the store was converted (ferry convert --group-size; default: "
                  "a ferry store's own, else 64)",
    "expert_hit_rate": "share of routed experts found on the GPU (e.g. measured); default: predicted from the routing",
    "expert_profile": "the engine's --expert-profile FILE (ferry profile): hottest experts pinned; predicts the hit rate",
    "routing": "routing that predicts the hit rate without a profile: uniform, zipf:S (e.g. zipf:1.2) or a profile FILE",
    "measure_bandwidth": "measure this machine's pinned host-to-GPU and host memory read rates and plan with them",
    "experts": "where expert misses run, as the engine's --experts: auto (hybrid decode), gpu, cpu",
    "mapped_experts": "plan the engine's --no-mapped-experts: every expert miss copied into a slot (no in-place "
                      "reads, no hybrid decode)",
    "cpu_share": "hybrid decode: share of the misses the host computes (default: balanced as the engine does)",
    "gpu_memory_budget": "SIZE the engine may allocate per GPU (weights, KV, buffers), as the engine's --gpu-memory-budget "
                         "takes it: 16GiB, 512MiB or bytes (2e9); G and GB count 2^30 as there. Below the model's size "
                         "it offloads",
    "gpu_memory_budget_gb": "deprecated: the budget in GB (10^9 bytes); use --gpu-memory-budget SIZE",
    "kv_cache_memory_gb": "GiB of KV cache per GPU, as the engine's --kv-cache-memory-gb (default: what the budget leaves)",
    "num_kv_blocks": "KV blocks per GPU, as the engine's --num-kv-blocks (wins over --kv-cache-memory-gb; default: what "
                     "the budget leaves)",
    "stream_buffers": "device buffers streamed dense layers rotate through, as the engine's --stream-buffers",
    "dequantize": "plan the engine's --dequantize: a GGUF's, a quantized store's or an FP8 checkpoint's packed weights "
                  "held dense",
    "place": "placement rule SELECTOR=gpu|cpu (e.g. experts=cpu), as the engine's --place",
    "concurrency": "sequences decoding together (default --max-num-seqs)",
}

_OWN = {"model", "device", "tensor_parallel_size", "pipeline_parallel_size"}
"""Engine knobs plan spells its own way: MODEL, --device (for --check), --tp / --pp (which take the engine's names)."""
_NO_EFFECT = {"seed", "tokenizer", "parallel_timeout", "profile_experts", "enable_prefix_caching"}
"""Engine knobs that change nothing the plan predicts (a profiling warm-up pays off at the next start; the plan's
workload shares no prefixes)."""


def _planned() -> set[str]:
    """Engine knobs plan has its own flags for."""
    return {f.name for f in dataclasses.fields(PlanOptions)} | _OWN


def _unplanned_fields():
    """The engine's knobs `PlanOptions` has no field for: plan takes them as the engine does (an engine command line
    plans as it is), `--check` runs them as given, and a note names those that differ from the default."""
    from ferrylm.cli import _engine_fields

    return [f for f, _ in _engine_fields() if f.name not in _planned()]


def _flag(f, value) -> str:
    """`f` set to `value` (not its default) as the engine's command line spells it (`cli.FLAG_EXTRAS`:
    --no-chunked-prefill)."""
    from ferrylm.cli import FLAG_EXTRAS

    name = f.name.replace("_", "-")
    if f.type == "bool":  # on by default: its flag turns it off
        return FLAG_EXTRAS.get(f.name, {}).get("flag", f"--no-{name}") if f.default else f"--{name}"
    return f"--{name} {value}"


_METAVAR = {"gpu_memory_budget": "SIZE", "gpu_memory_budget_gb": "GB", "kv_cache_memory_gb": "GIB", "gpu": "GPUS",
            "expert_profile": "FILE"}


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="what fits where and how fast, before launch (no GPU needed)")
    # a value that starts with a minus and a digit ("--gpu -1xH200") is a value, which the planner then names,
    # not an unknown flag (argparse's own rule takes plain negative numbers only)
    p._negative_number_matcher = re.compile(r"^-\d")
    # a bad value is one line naming it (as the planner's own errors print), not a usage dump
    p.error = lambda message: p.exit(2, f"ferry plan: error: {message} (ferry plan --help)\n")
    p.add_argument("model", nargs="?", help="catalog name (e.g. Qwen2-72B), config.json, model directory, .gguf or ferry store")
    from ferrylm.config import field_docs

    docs = field_docs(PlanOptions)  # a flag without its own help line says what its field's docstring says first
    for f in dataclasses.fields(PlanOptions):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        text = _HELP.get(f.name) or docs.get(f.name, "").split(". ")[0].strip().rstrip(".") or None
        if f.type == "bool":  # a knob on by default is turned off as the engine's CLI spells it: --no-NAME
            p.add_argument(flag if not f.default else "--no-" + flag[2:], dest=f.name,
                           action="store_false" if f.default else "store_true", help=text)
            continue
        if f.type.startswith("tuple"):
            p.add_argument(flag, action="append", default=[], help=text and text + " (repeatable)")
            continue
        if f.default is not None and "default" not in (text or ""):
            text = f"{text} (default {f.default})" if text else f"default {f.default}"
        conv = None if f.name == "gpu_memory_budget" else int if "int" in f.type else float if "float" in f.type else None
        alias = {"tp": ["--tensor-parallel-size"], "pp": ["--pipeline-parallel-size"]}.get(f.name, [])  # engine spelling
        p.add_argument(flag, *alias, type=conv or str, default=f.default, help=text, metavar=_METAVAR.get(f.name))
    from ferrylm.cli import add_engine_args

    engine = p.add_argument_group("engine options the plan does not model",
                                  "taken as the engine takes them, so an engine command line plans as it is; --check "
                                  "runs them as given, and the plan notes those that differ from the default")
    add_engine_args(engine, skip=_planned())
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--list", action="store_true", help="list the built-in models and hardware profiles (with --json: "
                   "one JSON object, each profile's figures too)")
    p.add_argument("--check", action="store_true",
                   help="run the engine briefly with these settings and print predicted vs measured (needs a CUDA "
                        "GPU and a MODEL with weights; plans with this machine's measured rates, as "
                        "--measure-bandwidth)")
    p.add_argument("--device", default="cuda", help="CUDA device for --check (default cuda)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(a: argparse.Namespace) -> None:
    from rich.console import Console

    from ferrylm.plan import report
    from ferrylm.plan.planner import make_plan

    if a.list:
        from ferrylm.plan.catalog import CATALOG
        from ferrylm.plan.hardware import GPUS, HOSTS

        if a.json:  # for machines: the names and each profile's figures
            import json

            print(json.dumps(dict(models=list(CATALOG), gpus={n: dataclasses.asdict(g) for n, g in GPUS.items()},
                                  hosts={n: dataclasses.asdict(h) for n, h in HOSTS.items()})))
            return
        print("models:", ", ".join(CATALOG))
        print("gpus:  ", ", ".join(GPUS))
        print("hosts: ", ", ".join(HOSTS))
        return
    if not a.model:
        from ferrylm.errors import ConfigError

        raise ConfigError("ferry plan needs a MODEL (a catalog name, config.json, directory, .gguf or store; --list)")
    if a.check:  # before planning: a check that cannot run here says so at once
        from ferrylm.errors import ConfigError
        from ferrylm.plan.check import refusal

        why = refusal(a.model, a.device, a.tp * a.pp)
        if why:
            raise ConfigError(why)
    values = {f.name: getattr(a, f.name) for f in dataclasses.fields(PlanOptions)}
    # a check compares the plan with this machine, so it plans with this machine's measured rates (session 37: mix4
    # under 2 GiB on an H100 predicted copy-only decode at half the speed the engine's hybrid share reached)
    values["measure_bandwidth"] = values["measure_bandwidth"] or a.check
    opts = PlanOptions(**{**values, "place": tuple(values["place"])})
    unplanned = {f.name: getattr(a, f.name) for f in _unplanned_fields() if getattr(a, f.name) != f.default}
    from ferrylm.config import engine_config

    engine_config(**unplanned)  # a value the engine refuses is refused here, as the engine words it
    plan = make_plan(opts)
    for f in _unplanned_fields():
        if f.name in unplanned and f.name not in _NO_EFFECT:
            default = ("on" if f.default else "off") if f.type == "bool" else "unset" if f.default is None else f.default
            plan.notes.append(f"not modelled: {_flag(f, unplanned[f.name])} (the figures assume the engine's default, "
                              f"{default}); --check runs it as given")
    check = None
    if a.check:
        from ferrylm.plan.check import run_check

        check = run_check(plan, a.model, a.device, **unplanned)
    if a.json:
        print(report.to_json(plan, check))
    else:
        console = Console(file=sys.stdout, width=120)
        report.render(plan, console)
        if check is not None:
            report.render_check(check, console)
