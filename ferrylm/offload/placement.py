"""Placement: which tensor group lives on the device and which in host memory, from a byte budget.

A model built on the `meta` device is cut into tensor groups (`group_tensors`): the embeddings, the
LM head, each layer's attention, norms, router, shared experts, dense MLP, and each expert of each MoE
layer. `place()` fills the device budget in order of how much each group would cost per decode token
if it lived in host memory: the groups that never leave the device first (norms, routers, the LM head:
`DEVICE_KINDS`), then every layer's attention, shared experts and dense MLPs (streamed layer by layer when
they do not fit),
then expert slots spread evenly over the MoE layers (misses are copied into the slots on demand; under a budget
too small for them, one pool of slots the layers share: `SHARED_EXPERT_SLOTS`), and the embeddings last (a lookup reads only the step's rows, so host memory costs nothing per token).

Rules override the order (`--place`, applied in the order given, later rules win):

    RULE     := SELECTOR "=" TIER          TIER := gpu | cpu
    SELECTOR := [ "layers." RANGE [ "." ] ] [ KIND [ "." RANGE ] ]
    RANGE    := N | N-M                    (inclusive)
    KIND     := embed | lm_head | attention | norm | router | shared_experts | mlp | experts

e.g. `experts=cpu` (every expert in host memory, none resident), `layers.0-7=gpu` (those layers'
groups resident), `layers.10-20.experts.0-3=gpu`, `lm_head=gpu`. `cpu` means host memory: the group is
streamed or cached onto the device when used. A rule that matches no group is an error.

This module only decides; it allocates nothing (`offload/weights.py` does that).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ferrylm.errors import ConfigError

KINDS = ("embed", "lm_head", "attention", "norm", "router", "shared_experts", "mlp", "experts")
GPU, HOST = "gpu", "cpu"


@dataclass(frozen=True)
class TensorGroup:
    name: str
    """e.g. `layers.3.attention`, `layers.3.experts.5`, `embed`."""
    kind: str
    layer: int | None
    expert: int | None
    params: tuple[str, ...]
    """Parameter names (for an expert: the bank's parameters, of which it owns row `expert`)."""
    nbytes: int


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def group_tensors(model: nn.Module) -> list[TensorGroup]:
    """The model's parameters as tensor groups (works on a model built on `meta`)."""
    from ferrylm.layers.moe import Experts
    from ferrylm.layers.norm import RMSNorm

    banks = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    norms = {name for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    layer_re = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    plain: dict[tuple[str, int | None], list[tuple[str, int]]] = {}
    groups: list[TensorGroup] = []
    for pname, p in model.named_parameters():  # a tied lm_head appears once, as the embeddings
        mod = pname.rpartition(".")[0]
        if mod in banks:
            continue
        m = layer_re.match(pname)
        layer = int(m[1]) if m else None
        rest = m[2] if m else pname
        if mod in norms:
            kind = "norm"
        elif layer is None:
            kind = "embed" if "embed" in rest else "lm_head" if rest.startswith("lm_head") else "norm"
        elif "shared_expert" in rest:
            kind = "shared_experts"
        elif rest.startswith("self_attn."):
            kind = "attention"
        elif any(b.startswith(f"model.layers.{layer}.") for b in banks) and re.match(r"^[^.]+\.gate(\.|$)", rest):
            kind = "router"
        else:
            kind = "mlp"
        owner = model.get_submodule(mod) if mod else model
        packed = getattr(owner, "packed_nbytes", None) if pname.endswith(".weight") else None
        plain.setdefault((kind, layer), []).append((pname, packed or _bytes(p)))
    tied = getattr(model, "tied", False)
    for (kind, layer), ps in plain.items():
        if tied and kind == "embed":
            kind = "lm_head"  # one tensor both looks up and projects: it must sit where the head runs
        name = kind if layer is None else f"layers.{layer}.{kind}"
        groups.append(TensorGroup(name, kind, layer, None, tuple(n for n, _ in ps), sum(b for _, b in ps)))
    for bname, bank in banks.items():
        layer = int(layer_re.match(bname + ".")[1])
        per = bank.packed_nbytes or (_bytes(bank.w13) + _bytes(bank.w2)) // bank.num_experts
        for e in range(bank.num_experts):
            groups.append(TensorGroup(f"layers.{layer}.experts.{e}", "experts", layer, e,
                                      (f"{bname}.w13", f"{bname}.w2"), per))
    return groups


# -- rules ----------------------------------------------------------------------------------------------

_RANGE = r"(\d+)(?:-(\d+))?"
_RULE = re.compile(rf"^(?:layers\.{_RANGE}\.?)?(?:({'|'.join(KINDS)})(?:\.{_RANGE})?)?$")


@dataclass(frozen=True)
class PlaceRule:
    text: str
    layers: tuple[int, int] | None
    kind: str | None
    experts: tuple[int, int] | None
    tier: str

    @classmethod
    def parse(cls, text: str) -> "PlaceRule":
        sel, eq, tier = text.partition("=")
        sel, tier = sel.strip(), tier.strip().lower()
        if not eq or tier not in (GPU, HOST):
            raise ConfigError(f"placement rule {text!r}: write SELECTOR=gpu or SELECTOR=cpu "
                              f"(e.g. experts=cpu, layers.0-7=gpu)")
        m = _RULE.match(sel)
        if not sel or not m or (m[5] and m[3] != "experts"):
            raise ConfigError(f"placement rule {text!r}: selector {sel!r} is not [layers.N[-M].][KIND[.N[-M]]] "
                              f"with KIND one of {', '.join(KINDS)} (expert ranges only after 'experts')")

        def rng(a, b):
            if a is None:
                return None
            lo, hi = int(a), int(b if b is not None else a)
            if hi < lo:
                raise ConfigError(f"placement rule {text!r}: range {lo}-{hi} is empty")
            return lo, hi

        return cls(text, rng(m[1], m[2]), m[3], rng(m[4], m[5]), tier)

    def matches(self, g: TensorGroup) -> bool:
        if self.layers is not None and (g.layer is None or not self.layers[0] <= g.layer <= self.layers[1]):
            return False
        if self.kind is not None and g.kind != self.kind:
            return False
        return self.experts is None or (g.expert is not None and self.experts[0] <= g.expert <= self.experts[1])


# -- the decision ---------------------------------------------------------------------------------------

@dataclass
class Placement:
    tier: dict[str, str]
    """group name -> gpu | cpu."""
    groups: list[TensorGroup]
    budget: int | None
    """Device bytes allowed for weights (None: unlimited, everything resident)."""
    stream_buffer_bytes: int = 0
    """Device bytes of the buffers that streamed dense layers rotate through (all buffers)."""
    expert_slots: dict[int, int] = field(default_factory=dict)
    """MoE layer -> device slots for experts that live in host memory (0 for fully resident layers)."""
    shared_slots: int = 0
    """Device slots of the pool that MoE layers with no expert on the device share (`SHARED_EXPERT_SLOTS`;
    `offload/expert_cache.SlotPool`): their copied misses land there, one layer after another."""
    shared_slot_bytes: int = 0
    """Bytes of one pool slot (the largest expert of those layers)."""
    slot_mode: str = "layer"
    """How layers with host experts copy their misses in, as `memory.size_memory` chose: `layer` (`min_expert_slots`
    slots each), `pool` (no slots a layer: through their resident experts, or the shared pool while they have none),
    `host` (no slots, no pool: `--experts cpu`, or auto with no room even for a shared slot; a layer with no free
    slot runs its copy-road misses on the host's cores)."""

    def pool_layers(self) -> list[int]:
        """The MoE layers that copy their misses into the shared pool: no slot and no expert of their own."""
        if not self.shared_slots:
            return []
        experts = [g for g in self.groups if g.kind == "experts"]  # (a pool means no slots a layer)
        return sorted({g.layer for g in experts} - {g.layer for g in experts if self.tier[g.name] == GPU})

    def on_gpu(self, g: TensorGroup) -> bool:
        return self.tier[g.name] == GPU

    @property
    def fully_resident(self) -> bool:
        return all(t == GPU for t in self.tier.values())

    def bytes_on(self, tier: str) -> int:
        return sum(g.nbytes for g in self.groups if self.tier[g.name] == tier)

    def streamed_layers(self) -> list[int]:
        """Layers with dense (non-expert) groups in host memory, streamed to the device each step."""
        return sorted({g.layer for g in self.groups if g.layer is not None and g.kind != "experts"
                       and self.tier[g.name] == HOST})

    def device_bytes(self) -> int:
        """Resident weights + stream buffers + expert slots: what the weights take on the device."""
        slot_bytes = sum(n * self._expert_bytes(layer) for layer, n in self.expert_slots.items())
        return self.bytes_on(GPU) + self.stream_buffer_bytes + slot_bytes + self.shared_slots * self.shared_slot_bytes

    def cache_capacity(self, layer: int) -> int:
        """Experts a cached MoE layer's device bank holds (`offload/expert_cache.CachedExperts`): its resident
        experts and its copy slots."""
        resident = sum(1 for g in self.groups if g.kind == "experts" and g.layer == layer and self.tier[g.name] == GPU)
        return resident + self.expert_slots.get(layer, 0)

    def largest_cache(self) -> int | None:
        """The largest `cache_capacity` of a layer with experts in host memory; None when no layer has any."""
        layers = {g.layer for g in self.groups if g.kind == "experts" and self.tier[g.name] == HOST}
        return max((self.cache_capacity(layer) for layer in layers), default=None)

    def _expert_bytes(self, layer: int) -> int:
        return next(g.nbytes for g in self.groups if g.kind == "experts" and g.layer == layer)

    def pcie_bytes_per_token(self, experts_per_token: float | None = None, host_experts: bool = False) -> int:
        """Bytes that cross to the device for one decode step of one token: every streamed dense group,
        plus the expected expert misses (`experts_per_token` distinct experts needed per MoE layer,
        each non-resident one with probability (non-resident share) under uniform routing), none when
        `host_experts` (`--experts cpu`: the host's cores run them)."""
        total = sum(g.nbytes for g in self.groups if g.kind != "experts" and self.tier[g.name] == HOST
                    and g.kind != "embed")
        if host_experts:
            return total
        by_layer: dict[int, list[TensorGroup]] = {}
        for g in self.groups:
            if g.kind == "experts":
                by_layer.setdefault(g.layer, []).append(g)
        for layer, gs in by_layer.items():
            host = sum(1 for g in gs if self.tier[g.name] == HOST)
            k = experts_per_token if experts_per_token is not None else 1
            total += int(k * host / len(gs) * gs[0].nbytes)
        return total


class _Ledger:
    """Device bytes of a tier assignment, updated in O(layers) per change (placement tries thousands)."""

    def __init__(self, groups: list[TensorGroup], tier: dict[str, str], stream_buffers: int, min_slots: int,
                 shared_slots: int = 0):
        self.groups, self.tier, self.nbuf, self.min_slots = groups, tier, stream_buffers, min_slots
        self.shared = shared_slots if not min_slots else 0
        self.pad = 256 * max((len(g.params) for g in groups), default=0)
        self.resident = 0
        self.streamed: dict[int, int] = {}
        self.host_experts: dict[int, int] = {}
        self.expert_bytes: dict[int, int] = {}
        self.experts: dict[int, int] = {}  # MoE layer -> its expert count
        for g in groups:
            if g.kind == "experts":
                self.experts[g.layer] = self.experts.get(g.layer, 0) + 1
            self._count(g, +1)

    def _count(self, g: TensorGroup, sign: int) -> None:
        if self.tier[g.name] == GPU:
            self.resident += sign * g.nbytes
        elif g.kind == "experts":
            self.host_experts[g.layer] = self.host_experts.get(g.layer, 0) + sign
        elif g.layer is not None:
            self.streamed[g.layer] = self.streamed.get(g.layer, 0) + sign * g.nbytes
        if g.kind == "experts":
            self.expert_bytes[g.layer] = g.nbytes

    def move(self, g: TensorGroup, to: str) -> None:
        self._count(g, -1)
        self.tier[g.name] = to
        self._count(g, +1)

    def slots(self) -> dict[int, int]:
        """Extra device slots per MoE layer for experts copied in on demand (at least `min_slots` while any
        expert of the layer lives in host memory; more would only be resident experts by another name)."""
        return {layer: min(n, self.min_slots) for layer, n in self.host_experts.items() if n > 0}

    def pool(self) -> tuple[int, int]:
        """(slots, bytes a slot) of the shared pool: while a layer has every expert in host memory and no slot."""
        bare = [layer for layer, n in self.host_experts.items() if n == self.experts[layer]]
        if not self.shared or not bare:
            return 0, 0
        return self.shared, max(self.expert_bytes[layer] for layer in bare)

    def buffer_bytes(self) -> int:
        top = max((b for b in self.streamed.values() if b > 0), default=0)
        return self.nbuf * (top + self.pad) if top else 0

    def total(self) -> int:
        slots = sum(n * self.expert_bytes[layer] for layer, n in self.slots().items())
        n, each = self.pool()
        return self.resident + self.buffer_bytes() + slots + n * each

    def placement(self, budget: int | None) -> Placement:
        mode = "layer" if self.min_slots else "pool" if self.shared else "host"
        return Placement(dict(self.tier), self.groups, budget, self.buffer_bytes(), self.slots(), *self.pool(), mode)


def _forced(groups: list[TensorGroup], rules: tuple[str, ...]) -> dict[str, str]:
    forced: dict[str, str] = {}
    last_head = ""
    for r in (PlaceRule.parse(r) for r in rules):
        hit = [g for g in groups if r.matches(g)]
        if not hit:
            layers = sorted({g.layer for g in groups if g.layer is not None})
            experts = sorted({g.expert for g in groups if g.expert is not None})
            have = ((f"; layers {_ranges(layers)}" if layers else "")
                    + (f", experts {_ranges(experts)}" if experts else ""))
            raise ConfigError(f"placement rule {r.text!r} matches no tensor group of this model "
                              f"(groups look like: {', '.join(sorted({_example(g) for g in groups}))}{have})")
        for g in hit:
            forced[g.name] = r.tier
            if g.kind == "lm_head" and r.tier == HOST:
                last_head = r.text
    if any(forced.get(g.name) == HOST for g in groups if g.kind == "lm_head"):
        raise ConfigError(f"placement rule {last_head!r} puts the LM head in host memory: it runs on the device "
                          f"each step (its bytes count toward the minimum budget)")
    return forced


DEVICE_KINDS = ("norm", "router", "lm_head")
"""Groups that always live on the device: every token reads norms and routers (tiny), and the LM head runs
there each step (it is a matmul over the whole vocabulary, not a lookup: nothing streams or computes it
from host memory)."""


def _smallest(groups, forced, stream_buffers, min_expert_slots, shared_slots=0) -> _Ledger:
    """Every group not forced in host memory, except `DEVICE_KINDS`."""
    tier = {g.name: forced.get(g.name, GPU if g.kind in DEVICE_KINDS else HOST) for g in groups}
    return _Ledger(groups, tier, stream_buffers, min_expert_slots, shared_slots)


MIN_EXPERT_SLOTS = 2
"""Device slots each MoE layer with experts in host memory keeps for the misses it copies in (a step's misses run in
waves through them when there are more). Per layer: the minimum budget grows with layers x expert bytes (bf16
Mixtral-8x7B: 21 GiB of slots alone; `SHARED_EXPERT_SLOTS` where the budget has no room for them)."""


SHARED_EXPERT_SLOTS = 2
"""Where the budget has no room for `MIN_EXPERT_SLOTS` a layer (`memory.size_memory`), the layers left with no expert
on the device share one pool of this many slots (`expert_cache.SlotPool`): the layers run one after another, so a
layer's copied misses (prefill, large batches) stream through the pool, one slot computing while the next copy lands,
instead of running on the host's cores. Decode steps read such a layer's misses in place (or split them with the
host) as before: nothing is promoted into the pool."""


def min_expert_slots(experts: str) -> int:
    """The slots a layer with host experts needs under `OffloadConfig.experts`: none with cpu, where every miss runs
    on the host's cores and nothing is copied in (`cost_model.split_misses`; hybrid decode at share 1). Resident
    experts still follow the routing there (`routing_tally` promotes into a resident expert's slot). So
    `--place experts=cpu --experts cpu` needs only the dense weights on the device, as llama.cpp's `-ot exps=CPU`."""
    return 0 if experts == "cpu" else MIN_EXPERT_SLOTS


def minimum_device_bytes(groups: list[TensorGroup], rules: tuple[str, ...] = (), *, stream_buffers: int = 2,
                         min_expert_slots: int = MIN_EXPERT_SLOTS, shared_slots: int = 0) -> int:
    """The fewest device bytes the weights can run in (norms, routers, the LM head, forced groups, stream
    buffers for the largest layer, expert slots per layer, or with none the shared pool's `shared_slots`)."""
    return _smallest(groups, _forced(groups, rules), stream_buffers, min_expert_slots, shared_slots).total()


def place(groups: list[TensorGroup], budget: int | None, rules: tuple[str, ...] = (), *,
          stream_buffers: int = 2, min_expert_slots: int = MIN_EXPERT_SLOTS, shared_slots: int = 0) -> Placement:
    """Decide each group's tier so the device bytes (resident groups, stream buffers, expert slots, the shared
    pool while a layer needs it) stay within `budget`. Raises `ConfigError` naming the minimum when even the
    smallest placement does not fit."""
    forced = _forced(groups, rules)
    if budget is None:
        ledger = _Ledger(groups, {g.name: forced.get(g.name, GPU) for g in groups}, stream_buffers,
                         min_expert_slots, shared_slots)
        return ledger.placement(None)
    # start from the fewest device bytes, then fill the budget in order of cost per token
    ledger = _smallest(groups, forced, stream_buffers, min_expert_slots, shared_slots)
    tier = ledger.tier
    if ledger.total() > budget:
        slots = (f", {min_expert_slots} expert slots per MoE layer" if min_expert_slots else
                 f", {shared_slots} shared expert slots" if ledger.pool()[0] else "")
        raise ConfigError(
            f"GPU memory budget {budget / 2**30:.2f} GiB is too small for this model: its weights need at least "
            f"{ledger.total() / 2**30:.2f} GiB on the device (norms, routers, the LM head, forced groups, stream "
            f"buffers for the largest layer{slots}), before the KV cache")
    free = [g for g in groups if g.name not in forced and tier[g.name] == HOST]
    experts = sorted((g for g in free if g.kind == "experts"), key=lambda g: (g.expert, g.layer))
    # experts round-robin over layers: slot j of every layer before slot j + 1 of any
    order = [g for kind in ("attention", "shared_experts", "mlp") for g in free if g.kind == kind]
    order += experts + [g for g in free if g.kind == "embed"]
    for g in order:
        ledger.move(g, GPU)
        if ledger.total() > budget:
            ledger.move(g, HOST)
    return ledger.placement(budget)


def _example(g: TensorGroup) -> str:
    if g.layer is None:
        return g.name
    return f"layers.N.{g.kind}" + (".N" if g.kind == "experts" else "")


def describe(pl: Placement, kv_bytes: int = 0, kv_tokens: int = 0, experts_per_token: float | None = None,
             host_experts: bool = False) -> str:
    """The start-up table: per kind, bytes on the device and in host memory; layers streamed; slots."""
    rows = []
    for kind in KINDS:
        gs = [g for g in pl.groups if g.kind == kind]
        if not gs:
            continue
        gpu = sum(g.nbytes for g in gs if pl.tier[g.name] == GPU)
        host = sum(g.nbytes for g in gs if pl.tier[g.name] == HOST)
        extra = ""
        if kind == "experts":
            layers = sorted({g.layer for g in gs})
            res = [sum(1 for g in gs if g.layer == layer and pl.tier[g.name] == GPU) for layer in layers]
            total = len(gs) // len(layers)
            extra = (f"resident per layer {min(res)}-{max(res)} of {total}, "
                     f"cache slots per layer {max(pl.expert_slots.values(), default=0)}")
            if pl.shared_slots:
                pool = pl.pool_layers()
                extra += (f", {pl.shared_slots} slots shared by layer(s) {_ranges(pool)} "
                          f"({size(pl.shared_slots * pl.shared_slot_bytes)})")
        rows.append(f"  {kind:<15} gpu {size(gpu):>11}   host {size(host):>11}   {extra}".rstrip())
    streamed = pl.streamed_layers()
    lines = ["placement (weight budget " + ("none" if pl.budget is None else size(pl.budget)) + "):", *rows]
    lines.append(f"  streamed layers {_ranges(streamed) or 'none'}; stream buffers {size(pl.stream_buffer_bytes)}; "
                 f"device weights {size(pl.device_bytes())}")
    if kv_bytes:
        lines.append(f"  KV cache {size(kv_bytes)} ({kv_tokens} tokens)")
    lines.append(f"  predicted host->device bytes per decode token: "
                 f"{size(pl.pcie_bytes_per_token(experts_per_token, host_experts))} "
                 + ("(missed experts run on the host's cores)" if host_experts else "(uniform routing)"))
    return "\n".join(lines)


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
