"""Expert popularity profiles: record how often each expert of each MoE layer is routed to over a
workload, write it as JSON (atomically), read it back for placement (its hottest experts start resident
and are never evicted). A profile that does not match the model (layers, experts) or cannot be read is
ignored with a warning: a stale file must not stop a server from starting. `warm_up` is the start-up
workload of `profile_experts` (`--profile-experts N`): it saves the model's profile where the next start
finds it (`saved`).

    {"format": "ferrylm-expert-profile/1", "architecture": ..., "num_experts": E,
     "layers": {"<layer>": [count per expert], ...},
     "decode_trace": {"<layer>": [[experts of step 0], [experts of step 1], ...], ...}}

`decode_trace` (optional) is the routing of one-token decode steps in order, the prompts run one at a time
after the counted workload (`record`'s `trace_steps`): how much a sequence reuses its experts from token to
token, which popularity alone does not say. `ferry plan` replays the engine's slot policy on it
(`plan/hit_rate.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random

import torch
from torch import nn

from ferrylm.files import write_atomic
from ferrylm.layers.moe import Experts

log = logging.getLogger(__name__)
FORMAT = "ferrylm-expert-profile/1"


PROMPTS = [
    "Explain how a ferry crosses a river with a strong current.",
    "用三句话介绍长江。",
    "def quicksort(xs):\n    # sort a list of integers\n",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "Write a short letter to a friend about a trip to the mountains.",
    "What is the derivative of x^3 * sin(x)?",
]
"""The built-in workload (`ferry profile` without --prompts, and `profile_experts`)."""


def saved_path(model) -> str | None:
    """Where `profile_experts` keeps `model`'s profile (by its real path); None for the embedded model or a
    weight source given as an object (benchmarks' random weights)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    from ferrylm.offload.calibration import cache_dir

    real = os.path.realpath(model)
    name = os.path.basename(real.rstrip(os.sep)) or "model"
    return os.path.join(cache_dir(), "expert-profiles", f"{name}-{hashlib.sha1(real.encode()).hexdigest()[:10]}.json")


def saved(model) -> str | None:
    """The saved profile of `model` if one exists (placement uses it when no profile is named)."""
    path = saved_path(model)
    return path if path is not None and os.path.exists(path) else None


TRACE_STEPS = 256
"""One-token decode steps `record` traces by default (prompts one at a time, after the counted workload)."""


def record(llm, prompts: list, params, seed: int = 0, trace_steps: int = TRACE_STEPS) -> dict:
    """Run `prompts` through `llm` (`ferrylm.LLM`) counting routing, then run them one at a time tracing the
    routing of each decode step until `trace_steps` steps are traced (or every prompt ran once more; 0: no
    trace); -> the profile. A model without a tokenizer gets seeded random token-id prompts of 32 tokens
    instead."""
    from ferrylm.errors import ConfigError

    engine = llm.engine
    model = engine.runner.model
    if not banks(model):
        raise ConfigError("this model has no experts to profile")
    if engine.tokenizer is None:
        rng = random.Random(seed)
        prompts = [[rng.randrange(engine.model_config.vocab_size) for _ in range(32)] for _ in prompts]
    start(model)  # counts stay on afterwards: graphs captured meanwhile write these tensors
    engine.runner.recapture_graphs()  # graphs captured before counted nothing
    llm.generate(prompts, params)
    profile = collect(model, engine.model_config.architecture)
    if trace_steps > 0:
        start_trace(model, trace_steps)
        engine.runner.recapture_graphs()
        for p in prompts:
            llm.generate([p], params)
            if traced_steps(model) >= trace_steps:
                break
        trace = collect_trace(model)
        if any(trace.values()):  # no one-token step ran (one token a prompt): no trace rather than an empty one
            profile["decode_trace"] = trace
    return profile


def warm_up(llm, n: int, model: str | None, seed: int = 0) -> str | None:
    """`profile_experts`: n prompts of the built-in mix, greedy, 64 tokens each; saves the profile for the
    next start (`saved_path`) and zeroes the offload counters (the warm-up is not the workload). -> the path (None,
    with a warning, where it cannot be written: the start goes on)."""
    from ferrylm.errors import ConfigError
    from ferrylm.sampling_params import SamplingParams

    path = saved_path(model)
    if path is None:
        raise ConfigError("profile_experts: the model is no path (the embedded model, or a source object): "
                          "nowhere to save its profile")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    # no decode trace: start-up time (the placement reads the counts; `ferry profile` writes a trace for the plan)
    profile = record(llm, prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, seed=seed), seed,
                     trace_steps=0)
    llm.engine.runner.placed.stats.reset()
    total = sum(sum(v) for v in profile["layers"].values())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(profile, path)
    except OSError as e:  # the profile only serves the next start: this one runs on
        log.warning("expert profile: cannot save it to %s (%s): set $FERRYLM_CACHE_DIR to a writable folder; "
                    "this start runs on without it", path, e.strerror or e)
        return None
    log.warning("expert profile: recorded %d routed assignments in %d MoE layers over %d warm-up prompt%s into %s; "
                "the next start pins each layer's hottest experts on the device", total, len(profile["layers"]), n,
                "s" * (n != 1), path)
    return path


def banks(model: nn.Module) -> dict[int, Experts]:
    return {int(name.split(".")[2]): m for name, m in model.named_modules() if isinstance(m, Experts)}


def _device(bank: Experts) -> torch.device:
    """Where a bank's routing runs (its counters live there)."""
    if bank.backend.__class__.__name__ == "CachedExperts":
        return bank.backend.device
    return bank.w13.device if not bank.w13.is_meta else torch.device("cpu")


def start(model: nn.Module) -> None:
    """Count routing from now on (every bank, on its device). Graphs captured before count nothing: the
    caller captures them again (`ModelRunner.recapture_graphs`), as `record` does."""
    for bank in banks(model).values():
        bank.routing_counts = torch.zeros(bank.num_experts, dtype=torch.long, device=_device(bank))


def start_trace(model: nn.Module, steps: int) -> None:
    """Trace the routing of the next `steps` one-token steps (every bank, on its device; see `record`).
    Graphs captured before trace nothing: as `start`."""
    for bank in banks(model).values():
        dev = _device(bank)
        bank.routing_trace = torch.zeros(steps + 1, bank.num_experts, dtype=torch.bool, device=dev)
        bank.routing_trace_pos = torch.zeros(1, dtype=torch.long, device=dev)


def traced_steps(model: nn.Module) -> int:
    return min((int(b.routing_trace_pos.item()) for b in banks(model).values() if b.routing_trace is not None),
               default=0)


def collect_trace(model: nn.Module) -> dict:
    """layer -> the experts of each traced step, in order; tracing stops (a graph captured meanwhile keeps
    writing its buffers, which nothing reads)."""
    n = traced_steps(model)
    out = {}
    for i, b in banks(model).items():
        if b.routing_trace is not None:
            rows = b.routing_trace[:n].cpu()
            out[str(i)] = [r.nonzero().flatten().tolist() for r in rows]
            b.routing_trace = b.routing_trace_pos = None
    return out


def collect(model: nn.Module, architecture: str) -> dict:
    layers = {str(i): b.routing_counts.tolist() for i, b in banks(model).items() if b.routing_counts is not None}
    E = next(iter(banks(model).values())).num_experts if layers else 0
    return {"format": FORMAT, "architecture": architecture, "num_experts": E, "layers": layers}


def write(profile: dict, path: str) -> None:
    """`profile` as JSON at `path`, whole or not at all, with a plain file's mode (`files.write_atomic`: a server
    run as another user reads it). Raises `OSError`."""
    write_atomic(path, json.dumps(profile, indent=1))


def load(path: str) -> object:
    """The file's JSON; raises `ValueError` naming what is wrong (unreadable, not JSON)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"cannot read it: not JSON ({e})") from None


def parse(path: str, architecture: str, num_experts: int, moe_layers: list[int], data=None) -> dict[int, list[int]]:
    """Per-layer counts (from `data`, the file's JSON, when the caller has `load`ed it); raises `ValueError` naming
    what is wrong (unreadable, not this format, recorded for another model). `ferry plan --expert-profile` reports it
    as an error; the engine's `read` warns."""
    if data is None:
        data = load(path)
    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        layers = {int(k): [int(c) for c in v] for k, v in data["layers"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read it ({e})") from None
    if data.get("architecture") != architecture or data.get("num_experts") != num_experts \
            or sorted(layers) != sorted(moe_layers) or any(len(v) != num_experts for v in layers.values()):
        raise ValueError(f"it was recorded for another model ({data.get('architecture')}, {data.get('num_experts')} "
                         f"experts, {len(layers)} MoE layers; this one: {architecture}, {num_experts} experts, "
                         f"{len(moe_layers)} MoE layers)")
    if any(c < 0 for v in layers.values() for c in v):
        raise ValueError("it has negative counts")
    return layers


def parse_trace(path: str, num_experts: int, moe_layers: list[int], data=None) -> dict[int, list[list[int]]] | None:
    """The profile's `decode_trace` (layer -> experts of each step; from `data`, the file's JSON, when the caller
    has `load`ed it), None when it has none; raises `ValueError` naming what is wrong. Call after `parse` accepted
    the file."""
    if data is None:
        data = load(path)
    raw = data.get("decode_trace")
    if not raw:
        return None
    try:
        trace = {int(k): [[int(e) for e in step] for step in v] for k, v in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"its decode_trace cannot be read ({e})") from None
    if sorted(trace) != sorted(moe_layers) or len({len(v) for v in trace.values()}) != 1:
        raise ValueError("its decode_trace does not cover every MoE layer for the same steps")
    if not next(iter(trace.values())):
        raise ValueError("its decode_trace holds no steps (record one with `ferry profile --trace-steps N` and "
                         "--max-tokens 2 or more)")
    if any(not 0 <= e < num_experts for v in trace.values() for step in v for e in step):
        raise ValueError(f"its decode_trace names an expert outside 0-{num_experts - 1}")
    return trace


def read(path: str, architecture: str, num_experts: int, moe_layers: list[int]) -> dict[int, list[int]] | None:
    """Per-layer counts, or None (with a warning) when the file is unreadable or made for another model."""
    try:
        return parse(path, architecture, num_experts, moe_layers)
    except ValueError as e:
        log.warning("expert profile %s ignored: %s", path, e)
        return None
