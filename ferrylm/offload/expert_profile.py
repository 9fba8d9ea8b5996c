"""Expert popularity profiles: record how often each expert of each MoE layer is routed to over a
workload, write it as JSON (atomically), read it back for placement (its hottest experts start resident
and are never evicted). A profile that does not match the model (layers, experts) or cannot be read is
ignored with a warning: a stale file must not stop a server from starting.

    {"format": "ferrylm-expert-profile/1", "architecture": ..., "num_experts": E,
     "layers": {"<layer>": [count per expert], ...}}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch
from torch import nn

from ferrylm.layers.moe import Experts

log = logging.getLogger(__name__)
FORMAT = "ferrylm-expert-profile/1"


def banks(model: nn.Module) -> dict[int, Experts]:
    return {int(name.split(".")[2]): m for name, m in model.named_modules() if isinstance(m, Experts)}


def start(model: nn.Module) -> None:
    """Count routing from now on (every bank, on its device)."""
    for bank in banks(model).values():
        dev = bank.w13.device if not bank.w13.is_meta else torch.device("cpu")
        if bank.backend.__class__.__name__ == "CachedExperts":
            dev = bank.backend.device
        bank.routing_counts = torch.zeros(bank.num_experts, dtype=torch.long, device=dev)


def collect(model: nn.Module, architecture: str) -> dict:
    layers = {str(i): b.routing_counts.tolist() for i, b in banks(model).items() if b.routing_counts is not None}
    E = next(iter(banks(model).values())).num_experts if layers else 0
    return {"format": FORMAT, "architecture": architecture, "num_experts": E, "layers": layers}


def write(profile: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(profile, f, indent=1)
    os.replace(tmp, path)


def parse(path: str, architecture: str, num_experts: int, moe_layers: list[int]) -> dict[int, list[int]]:
    """Per-layer counts; raises `ValueError` naming what is wrong (unreadable, not this format, recorded for
    another model). `ferry plan --expert-profile` reports it as an error; the engine's `read` warns."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"cannot read it: not JSON ({e})") from None
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


def read(path: str, architecture: str, num_experts: int, moe_layers: list[int]) -> dict[int, list[int]] | None:
    """Per-layer counts, or None (with a warning) when the file is unreadable or made for another model."""
    try:
        return parse(path, architecture, num_experts, moe_layers)
    except ValueError as e:
        log.warning("expert profile %s ignored: %s", path, e)
        return None
