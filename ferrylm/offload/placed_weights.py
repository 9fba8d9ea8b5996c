"""PlacedWeights: puts a meta-built model's parameters where a `Placement` says, and drives the weight
movement around the runner's layer loop.

While loading it is the parameter allocator (`layers.params`): resident groups get device memory, dense
groups of streamed layers and expert banks with experts off the device get host-tier memory, the
embeddings stay in host memory when placed there. After loading, `finish()` builds the `LayerStreamer`
for streamed layers and a `CachedExperts` backend for every bank not wholly resident (fully resident
banks get the fused backend on CUDA). The runner calls `before_layer(i)` / `after_layer(i)` around each
layer; `stats` counts what moved.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from ferrylm.errors import ConfigError
from ferrylm.layers.moe import Experts
from ferrylm.offload.expert_cache import CachedExperts, SlotPool, StagingSlots
from ferrylm.offload.host_tier import HostTier
from ferrylm.offload.placement import GPU, Placement
from ferrylm.offload.routing_tally import RoutingTally
from ferrylm.offload.share_tuner import ShareTuner
from ferrylm.offload.streamer import LayerStreamer

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """What the offload engine moved and computed. The host expert workers count beside the engine thread:
    counters more than one thread writes (`cpu_experts`, `cpu_busy_s`, `cpu_wait_s`) change through `add`
    only, under one lock (a bare `+=` from two threads can lose updates)."""

    h2d_bytes: int = 0
    """Bytes copied host -> device for weights (streamed layers and expert misses)."""
    expert_hits: int = 0
    expert_misses: int = 0
    weight_waits: int = 0
    """Times the compute stream had to wait for a copy that had not landed when the layer was enqueued."""
    weight_wait_s: float = 0.0
    """Seconds the compute stream sat waiting for those copies: the device idle for weights, timed by a CUDA event
    pair around each such wait (`wait`) and counted once the step's events have completed (`collect`)."""
    cpu_experts: int = 0
    """Misses computed on the host's cores (hybrid)."""
    cpu_busy_s: float = 0.0
    """Seconds the CPU pool spent computing experts."""
    cpu_wait_s: float = 0.0
    """Seconds the step waited for CPU expert results after its device work was enqueued."""
    copied_experts: int = 0
    """Misses copied into a device slot before they computed (the copy path)."""
    staged_experts: int = 0
    """Experts copied ahead of their layer's routing into staging slots (`expert_cache.StagingSlots`; counted in
    `copied_experts` too)."""
    staged_unused: int = 0
    """Staged experts their layer's step did not route to (copied for nothing)."""
    mapped_experts: int = 0
    """Misses the device read in place from mapped host memory (mapped decode steps)."""
    cpu_share: float = 0.0
    """Share of the last step's non-resident experts computed on the host's cores (a gauge: the split the
    cost model chose; 0 when every miss is copied or read in place)."""
    steps: int = 0
    """Steps run (the denominator of the per-step figures)."""
    step_s: float = 0.0
    """Host seconds of the steps' `execute` (on CUDA mostly their launch: the device runs behind it)."""
    device_step_s: float = 0.0
    """CUDA: seconds the device spent on the steps, event-timed from each step's start to the next one's (what the
    stream ran between them too: landing promotions), or to its own end where the host idled `IDLE_GAP_S` before
    the next (`begin_step`, `end_step`). 0 on the CPU engine, whose steps' `step_s` is the device's time."""

    IDLE_GAP_S = 1.0
    """A host gap between steps longer than this is idle (no request), not part of a step's device time."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # not fields: `asdict` and `reset` never see them
        self._clear_events()

    def _clear_events(self) -> None:
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (before, after) a weight wait
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) of a step on the device
        self._start = None  # the running step's start event
        self._ended = None  # (start, end event, host time) of the last step, until the next starts

    @staticmethod
    def _mark(stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def begin_step(self, stream) -> None:
        """A step starts on `stream`: the last step's device span ends here, unless the host idled in between."""
        start = self._mark(stream)
        if self._ended is not None:
            first, end, at = self._ended
            self._spans.append((first, start if time.perf_counter() - at < self.IDLE_GAP_S else end))
            self._ended = None
        self._start = start

    def end_step(self, stream) -> None:
        """The step begun last has all its work queued on `stream`."""
        if self._start is not None:
            self._ended, self._start = (self._start, self._mark(stream), time.perf_counter()), None

    def wait(self, stream, ready) -> None:
        """`stream` waits for `ready`, a weight copy's event. One that has not landed when the wait is enqueued
        counts in `weight_waits`, and the time `stream` then sits waiting, between an event recorded before the
        wait and one after it, in `weight_wait_s` (read once both have completed: `collect`)."""
        if ready.query():
            stream.wait_event(ready)
            return
        self.weight_waits += 1
        before = self._mark(stream)
        stream.wait_event(ready)
        self._stalls.append((before, self._mark(stream)))

    def collect(self) -> None:
        """Add the timed waits and step spans whose events have completed to `weight_wait_s` and `device_step_s`
        (the others wait for a later call; never blocks). A last step followed by `IDLE_GAP_S` of idle host ends
        at its own end."""
        if self._ended is not None and time.perf_counter() - self._ended[2] >= self.IDLE_GAP_S:
            self._spans.append(self._ended[:2])
            self._ended = None
        for pairs, field in ((self._stalls, "weight_wait_s"), (self._spans, "device_step_s")):
            still = []
            for a, b in pairs:
                if b.query():
                    setattr(self, field, getattr(self, field) + a.elapsed_time(b) / 1e3)
                else:
                    still.append((a, b))
            pairs[:] = still

    def add(self, **counts) -> None:
        """counter += value for each `counter=value`, atomically: safe from any thread."""
        with self._lock:
            for name, v in counts.items():
                setattr(self, name, getattr(self, name) + v)

    def reset(self) -> None:
        """Counters to 0 (the gauge `cpu_share` keeps its value; waits not yet read back are dropped)."""
        with self._lock:
            self._clear_events()
            for f in dataclasses.fields(self):
                if f.name != "cpu_share":
                    setattr(self, f.name, type(getattr(self, f.name))())

    @property
    def hit_rate(self) -> float | None:
        n = self.expert_hits + self.expert_misses
        return self.expert_hits / n if n else None

    @property
    def busy_s(self) -> float:
        """Seconds the steps kept the device: `device_step_s` on CUDA, `step_s` on the CPU engine."""
        return self.device_step_s or self.step_s

    @property
    def cpu_busy_share(self) -> float | None:
        """Host seconds computing experts per second of the steps' device time (above 1: more than one worker)."""
        return self.cpu_busy_s / self.busy_s if self.busy_s > 0 else None

    @property
    def weight_wait_share(self) -> float | None:
        """Fraction of the steps' device time the device sat waiting for weight copies."""
        return self.weight_wait_s / self.busy_s if self.busy_s > 0 else None

    def per_step(self) -> str:
        """One line of per-step figures for `--stats`."""
        n = max(self.steps, 1)
        busy = "n/a" if self.cpu_busy_share is None else f"{self.cpu_busy_share:.0%}"
        return (f"per step: {self.expert_hits / n:.1f} experts hit on the device, {self.copied_experts / n:.1f} "
                f"copied, {self.mapped_experts / n:.1f} read in place, {self.cpu_experts / n:.1f} on the CPU; CPU busy "
                f"{busy}, device waited {self.cpu_wait_s / n * 1e3:.2f} ms for CPU results and "
                f"{self.weight_wait_s / n * 1e3:.2f} ms for weight copies")


REBALANCE_WINDOW = (16, 64)
"""Mapped steps (start, end) over which an engine whose share the calibration chose counts its misses, once, to
re-balance the share (`PlacedWeights.after_results`): the calibration assumes uniform routing, where the slots of a
served model catch most of it (session 16, Mixtral 32L int4 under 16 GiB: 1.17 misses a layer assumed, 0.05 seen;
the calibrated share 0.33 decoded 26.9 tok/s where share 0 ran 31.1). The first steps warm the slots."""
REBALANCE_MIN_CHANGE = 0.1
"""Smallest change of share the re-balance applies (a change re-captures graphs and builds host kernels)."""


class PlacedWeights:
    def __init__(self, model: nn.Module, placement: Placement, device: torch.device, policy: str = "lru",
                 profile: str | None = None, stream_buffers: int = 2, moe_backend: str = "auto",
                 experts: str = "auto", cpu_threads: int | None = None, mapped_experts: bool = True,
                 cpu_share: float | None = None, cpu_numa_node: int | None = None, hybrid_split: bool = True):
        self.model, self.placement, self.device = model, placement, device
        self.target = device
        self.policy, self.stream_buffers, self.moe_backend = policy, stream_buffers, moe_backend
        # on the CPU engine both tiers are host memory: "auto" has nothing to balance and copies
        self.experts = "gpu" if experts == "auto" and device.type != "cuda" else experts
        self.experts_option = experts  # as given (`_pool_for`: only --experts gpu refuses a layer the pool cannot take)
        self.cpu_threads = cpu_threads
        self.mapped_experts = mapped_experts
        self.cpu_share, self.hybrid_split = cpu_share, hybrid_split
        self.host_decode = None
        self.costs = None
        self.tally: RoutingTally | None = None
        self.cpu_pool = None
        self.calibration: dict | None = None
        self.stats = OffloadStats()
        from ferrylm.hw.cpu_binding import node_cpus

        # the node's CPUs run the expert worker; its memory holds the host tier (bound before pinning)
        self.expert_cpus = node_cpus(cpu_numa_node) if cpu_numa_node is not None else None
        self.host = HostTier(pin=device.type == "cuda", numa_node=cpu_numa_node if self.expert_cpus else None,
                             device=device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.name_of = {id(p): n for n, p in model.named_parameters()}
        tier_of_param: dict[str, str] = {}
        bank_gpu: dict[str, list[bool]] = {}
        for g in placement.groups:
            on = placement.tier[g.name]
            if g.kind == "experts":
                bank_gpu.setdefault(g.params[0], []).append(on == GPU)
                continue
            for pname in g.params:
                tier_of_param[pname] = on
        for w13, flags in bank_gpu.items():
            on = GPU if all(flags) else "cpu"
            tier_of_param[w13] = tier_of_param[w13[:-len("w13")] + "w2"] = on
        self.tier_of_param = tier_of_param
        self.profile_path = profile
        self.profile_note = None
        self.streamer: LayerStreamer | None = None
        self.caches: dict[int, CachedExperts] = {}
        self.staging: StagingSlots | None = None
        """Slots the cached layers share to stage the next layer's experts on a copy-road step (None: none)."""
        self.pool: SlotPool | None = None
        """Slots the cached layers without an expert on the device copy their misses into (`Placement.shared_slots`)."""
        self._closing = threading.Event()  # set by `close()`: the host-kernel build thread stops
        self._prepare_threads: list[threading.Thread] = []
        # the re-balance: False (off), None (armed), then (steps, misses) at its window's start
        self._rebalance: tuple[int, int] | None | bool = False
        self.pending_share: float | None = None
        """A share the re-balance or the tuner chose, applied by the runner between steps (`apply_pending_share`)."""
        self.tuner: ShareTuner | None = None
        """Tunes a calibrated share on measured step times once the re-balance is done (`offload/share_tuner.py`)."""
        self._tune_last: tuple[float, int | None] = (0.0, None)  # (time, tokens) of the step before
        self._tune_tokens: int | None = None  # the batch shape the tuner times (the first it sees)

    # -- the allocator the loader writes through (layers.params.Allocator) ---------------------------

    def _tier(self, module: nn.Module, attr: str) -> str:
        name = self.name_of[id(getattr(module, attr))]
        return self.tier_of_param.get(name, GPU)

    def placed_device(self, module: nn.Module, attr: str) -> torch.device:
        return self.target if self._tier(module, attr) == GPU else torch.device("cpu")

    def allocate_like(self, module: nn.Module, attr: str, shape, dtype: torch.dtype) -> torch.Tensor:
        p = getattr(module, attr)
        if not p.is_meta:  # already materialised (a weight written densely, then a packed piece): beside it
            return torch.empty(shape, dtype=dtype, device=p.device)
        if self._tier(module, attr) == GPU:
            return torch.empty(shape, dtype=dtype, device=self.device)
        name = self.name_of[id(p)]
        if ".layers." not in f".{name}":
            return torch.empty(shape, dtype=dtype)  # embeddings on the host: looked up, never copied
        return self.host.empty(shape, dtype)

    def allocate(self, module: nn.Module, attr: str) -> torch.Tensor:
        p = getattr(module, attr)
        if isinstance(module, nn.Embedding):
            return torch.empty(p.shape, dtype=p.dtype, device=self.placed_device(module, attr))
        return self.allocate_like(module, attr, p.shape, p.dtype)

    # -- after loading --------------------------------------------------------------------------------

    def finish(self) -> None:
        from ferrylm.layers.fused_moe import FusedExperts

        from ferrylm.layers.linear import Linear

        streamed: dict[int, list] = {}
        for name, p in self.model.named_parameters():
            if self.tier_of_param.get(name, GPU) == GPU or p.is_meta or not name.startswith("model.layers."):
                continue
            mod = self.model.get_submodule(name.rpartition(".")[0])
            if isinstance(mod, Experts):
                continue
            layer = int(name.split(".")[2])
            streamed.setdefault(layer, []).append((lambda v, p=p: setattr(p, "data", v), p.data))
            if isinstance(mod, Linear) and name.endswith(".weight") and mod.kernels and self.device.type == "cuda":
                # packed weight of a streamed layer (its kernels are the device's reference ones, see
                # Linear.finish_load): the parts cross PCIe packed, the device dequantizes
                for qt, part in mod.packed_parts():
                    streamed[layer].append((lambda v, qt=qt, part=part: qt.parts.__setitem__(part, v), qt.parts[part]))
        if streamed:
            self.streamer = LayerStreamer(streamed, self.stream_buffers, self.device, self.copy_stream, self.stats)
        from ferrylm.offload import expert_profile

        moe = expert_profile.banks(self.model)
        profile = None
        if self.profile_path and moe:
            E = next(iter(moe.values())).num_experts
            profile = expert_profile.read(self.profile_path, self.model.config.architecture, E, sorted(moe))
        moved = []
        for name, bank in self.model.named_modules():
            if not isinstance(bank, Experts):
                continue
            layer = int(name.split(".")[2])
            if self.tier_of_param[f"{name}.w13"] == GPU:
                if self.moe_backend == "auto" and FusedExperts.supports(bank):
                    bank.backend = FusedExperts()
                continue
            groups = [g for g in self.placement.groups if g.kind == "experts" and g.layer == layer]
            resident = [g.expert for g in groups if self.placement.tier[g.name] == GPU]
            capacity = self.placement.cache_capacity(layer)
            pinned: set[int] = set()
            host_w13, host_w2 = bank.packed or (bank.w13.data, bank.w2.data)
            if profile is not None:
                counts = profile[layer]
                hot = sorted(range(bank.num_experts), key=lambda e: (-counts[e], e))[:len(resident)]
                covered = sum(counts[e] for e in hot) / max(sum(counts), 1)
                moved.append((len(set(hot) - set(resident)), covered))
                # pinned where the layer keeps slots to copy misses into besides them, or runs its misses on the
                # host; placed without slots a layer (`Placement.slot_mode` pool) it copies through its residents,
                # which must stay evictable (whether or not another layer still needs the shared pool)
                resident, pinned = hot, set(hot) if self.placement.slot_mode != "pool" else set()
            pool = self._pool_for(layer, host_w13, host_w2) if capacity == 0 else None
            bank.backend = CachedExperts(bank, host_w13, host_w2, capacity, resident, pinned, self.policy,
                                         self.device, self.copy_stream, self.stats, layer,
                                         use_fused=self.moe_backend == "auto", pool=pool)
            self.caches[layer] = bank.backend
        self._link_staging()
        if moved:
            pinned = "" if self.placement.slot_mode == "pool" else " and pinned"  # (no slots a layer: none pinned)
            self.profile_note = (f"expert profile {self.profile_path}: the hottest experts of each layer are resident"
                                 f"{pinned} ({sum(m for m, _ in moved)} changed from the default choice); they took "
                                 f"{sum(c for _, c in moved) / len(moved):.0%} of the recorded routing")
            log.warning("%s", self.profile_note)
        # dense or packed: host experts compute the bank's format; also where a layer has no slot to copy into
        # (auto under a tight budget: `memory.size_memory`; on the CPU engine auto copies, `self.experts` "gpu")
        if self.caches and (self.experts != "gpu" or not all(c.copy_slots for c in self.caches.values())):
            self._start_hybrid()
        if self.caches and self.mapped_experts and all(
                c.fused and all(self.host.is_mapped(t) for t in c.host_parts()) for c in self.caches.values()):
            self.tally = RoutingTally(self.caches, self.device, self.stats)
            if self.costs is not None:
                self._start_host_decode()
        if self.caches and self.experts == "cpu" and self.host_decode is None:  # no copies, no in-place reads:
            self._lay_host_experts(list(range(next(iter(self.caches.values())).host_w13.shape[0])))  # one int4 copy

    def _pool_for(self, layer: int, host_w13, host_w2) -> SlotPool | None:
        """The shared slots a layer with no expert of its own copies its misses into (`Placement.shared_slots`; made
        on the first such layer), None where the placement has none or its experts do not fit them (another shape or
        format: a warning, and its copy-road misses run on the host; `--experts gpu` refuses)."""
        if not self.placement.shared_slots:
            return None
        if self.pool is None:
            self.pool = SlotPool(host_w13, host_w2, self.placement.shared_slots, self.device)
        if self.pool.fits(host_w13, host_w2):
            return self.pool
        if self.experts_option == "gpu":
            raise ConfigError(f"MoE layer {layer}'s experts differ in shape or format from those of the other layers "
                              f"that share the expert slot pool: --experts gpu cannot copy them in under this budget "
                              f"(--experts auto runs them on the host's cores, or raise --gpu-memory-budget)")
        log.warning("MoE layer %d's experts differ in shape or format from the shared expert slots': its copy-road "
                    "misses run on the host's cores", layer)
        return None

    def _link_staging(self) -> None:
        """Copy-road staging (`expert_cache.StagingSlots`): for large experts computed one a round, up to
        `CachedExperts.staging_slots` slots of the first cached layer (not its pinned experts') that the others
        share to stage the next layer's experts; no memory beyond the caches'. On CUDA (the CPU engine with
        `CachedExperts.staging_on_cpu`)."""
        order = [l for l in sorted(self.caches) if self.caches[l].pool is None]  # pool layers neither stage nor lend
        if not order or (self.device.type != "cuda" and not CachedExperts.staging_on_cpu):
            return
        donor = self.caches[order[0]]
        n = min(CachedExperts.staging_slots, donor.copy_slots)
        if (n <= 0 or len(order) < 3 or not CachedExperts.one_large_a_round
                or donor.expert_bytes < CachedExperts.large_expert_bytes):
            return
        self.staging = donor.staging = StagingSlots(donor, n)
        for a, b in zip(order[1:], order[2:]):  # the donor stages for none: its slots are taken after it ran
            self.caches[a].link(self.caches[b], self.staging)
        log.info("copy-road staging: %d slots of layer %d's expert cache, shared by the cached layers", n, order[0])

    def _start_host_decode(self) -> None:
        """Hybrid decode: a share of each layer's missed experts is computed by the host while not in a slot
        (split along the intermediate with `hybrid_split`). The share balances the host's expert rate against
        the in-place read rate, counting the fixed costs of a host call measured here through the real
        hand-off (`cost_model.cpu_share`); at share 0 hybrid decode stays off."""
        from ferrylm.hw.cpu_binding import bind_thread
        from ferrylm.offload.host_decode import HostDecode

        share = self.cpu_share
        if share is None and self.experts == "cpu":
            share = 1.0
        if share is not None and share <= 0:
            self.cpu_share = 0.0
            return
        first = next(iter(self.caches.values()))
        H = first.host_w13.shape[2]
        hd = HostDecode({l: c.host_experts for l, c in self.caches.items()},  # shared with the copy path
                        max(c.mapped_tokens for c in self.caches.values()),
                        self.model.config.num_experts_per_tok, H, first.dtype, self.stats, self.device)
        if self.expert_cpus:  # the decode worker waits for its first hand-off: bound before any torch work
            threads = self.cpu_threads or self.calibration.get("threads")
            bind_thread(self.expert_cpus, threads, tid=hd.thread.native_id)
        if share is None:
            share, why = self._balanced_share(hd)
            if share <= 0:
                log.warning("hybrid decode off: %s", why)
                hd.close()
                self.cpu_share = self.stats.cpu_share = 0.0
                return
            log.info("hybrid decode: %s", why)
            self.host_decode = hd
            self.set_cpu_share(share)
            self.arm_rebalance()
            return
        self.host_decode = hd
        self.set_cpu_share(share)

    def arm_rebalance(self) -> None:
        """Count the misses of the next mapped steps (`REBALANCE_WINDOW`) and re-balance the share on them once;
        armed at start where the calibration chose the share, disarmed by `set_cpu_share`."""
        self._rebalance = None

    def _maybe_rebalance(self) -> None:
        t = self.tally
        if self._rebalance is False or t is None or self.host_decode is None:
            return
        a, b = REBALANCE_WINDOW
        if self._rebalance is None:
            if t.mapped_steps >= a:
                self._rebalance = (t.mapped_steps, t.mapped_misses)
            return
        s0, m0 = self._rebalance
        if t.mapped_steps - s0 < b - a:
            return
        self._rebalance = False  # once
        from ferrylm.offload.cost_model import cpu_share

        misses = (t.mapped_misses - m0) / (t.mapped_steps - s0) / len(self.caches)
        c = self.costs
        gbs = c.inplace_gbs or 0.85 * c.expert_bytes / c.copy_s / 1e9
        split = self.hybrid_split and next(iter(self.caches.values())).host_experts.splittable
        share = cpu_share(c, gbs, misses=misses, split=split)
        before = self.cpu_share or 0.0
        self.calibration = {**(self.calibration or {}), "measured_misses": misses, "rebalanced_share": share}
        if abs(share - before) >= REBALANCE_MIN_CHANGE or (share <= 0) != (before <= 0):
            self.pending_share = share
            log.warning("hybrid decode: %.2f misses a layer seen over %d steps (%.2f assumed): share %.2f -> %.2f",
                        misses, t.mapped_steps - s0, (self.calibration or {}).get("expected_misses", float("nan")),
                        before, share)
        else:
            share = before
        if share > 0:  # the host has misses to take: time the shares around this one (at 0 it has none)
            self.tuner, self._tune_tokens = ShareTuner(share), None

    def _tune(self, now: float, tokens: int | None) -> None:
        """Feed the tuner the period since the step before when both were decode steps of the batch shape it
        times and no host kernels are being built beside them; queue the share it asks for."""
        (before, last), self._tune_last = self._tune_last, (now, tokens)
        if tokens is None or tokens != last or tokens > max(c.mapped_tokens for c in self.caches.values()):
            return
        if self._tune_tokens is None:
            self._tune_tokens = tokens
        if tokens != self._tune_tokens or any(p.is_alive() for p in self._prepare_threads):
            return
        tuner = self.tuner
        nxt = tuner.observe(now - before)
        if nxt is not None:
            self.pending_share = nxt
        if tuner.done:
            self.tuner = None
            periods = {f"{k:.2f}": round(v * 1e3, 2) for k, v in sorted(tuner.measured.items())}
            self.calibration = {**(self.calibration or {}), "tuned_share": tuner.best, "tuned_step_ms": periods}
            log.warning("hybrid decode: share tuned on %d-token steps to %.2f (median step ms by share: %s)",
                        tokens, tuner.best, periods)

    def apply_pending_share(self) -> bool:
        """Between steps (the runner): apply the share the re-balance or the tuner queued (`pending_share`); True when
        one was applied (the caller drops its captured graphs: the column split is baked into them). The device is
        drained first, and a step still in flight (async scheduling) has its routing counts read under the classes
        it ran with."""
        share, self.pending_share = self.pending_share, None
        if share is None or self.host_decode is None:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.after_results()
        self._set_share(share)
        return True

    def _balanced_share(self, hd) -> tuple[float, str]:
        """(share, why) from the calibrated costs and a hand-off's fixed costs measured on `hd`: `handoff_s`
        with no host work, `call_s` from one expert whole and split in half (an expert's fixed cost is what
        two halves cost beyond the whole), at the misses a batch-1 step expects per layer (k times the share
        of experts not held on the device; uniform routing)."""
        import dataclasses

        from ferrylm.offload.cost_model import cpu_share

        c = self.costs
        layer, cache = next(iter(self.caches.items()))
        E, k = cache.host_w13.shape[0], self.model.config.num_experts_per_tok
        e = next((x for x in range(E) if x not in cache.pinned), 0)
        split = self.hybrid_split and cache.host_experts.splittable
        I, unit = cache.host_w2.shape[2], cache.host_experts.split_unit
        half = max(unit, round(I / 2 / unit) * unit)
        halves = split and half < I
        # a dense bank split in halves: its host GEMM path (`layers/cpu_experts.dense_gemm`, chosen by the
        # calibration on whole experts) chosen again on the column windows a split step runs (session 15,
        # Mixtral 16L at share 0.45: whole experts took split-x4, windows plain 8.05 tok/s against its 5.88)
        from ferrylm.layers import cpu_experts

        gemms = (cpu_experts.dense_gemm,)
        if halves and isinstance(cache.host_w13, torch.Tensor):
            gemms = cpu_experts.usable(cpu_experts.DENSE_GEMMS) or gemms

        def use(g):
            return lambda: setattr(cpu_experts, "dense_gemm", g)

        cases = [(None, 0, None)] + [(e, 0, use(g)) for g in gemms]
        cases += [(e, half, use(g)) for g in gemms] if halves else []
        before = cpu_experts.dense_gemm
        try:
            handoff, *got = hd.round_trip_s(layer, cases)
        except BaseException:
            cpu_experts.dense_gemm = before
            raise
        wholes, parts = dict(zip(gemms, got[:len(gemms)])), dict(zip(gemms, got[len(gemms):]))
        g = min(parts, key=parts.get) if parts else gemms[0]
        cpu_experts.dense_gemm = g
        whole, part = wholes[g] - handoff, [parts[g]] if parts else []
        call = 0.0
        if halves:
            f = (I - half) / I  # the share of columns the host computes at `half`
            call = max(0.0, min(whole, (part[0] - handoff - f * whole) / (1 - f)))
        misses = sum(k * (1 - min(cc.kept, E) / E) for cc in self.caches.values()) / len(self.caches)
        self.costs = c = dataclasses.replace(c, handoff_s=max(handoff, 0.0), call_s=call)
        gbs = c.inplace_gbs or 0.85 * c.expert_bytes / c.copy_s / 1e9  # else ~0.85 of the copy engine's (H200)
        share = cpu_share(c, gbs, misses=misses, split=split)
        self.calibration = {**(self.calibration or {}), "handoff_s": c.handoff_s, "call_s": call,
                            "host_whole_s": whole,
                            "host_half_s": part[0] - handoff if part else None, "expected_misses": misses,
                            **({"dense_gemm_split": g,
                                "host_half_s_by_gemm": {o: t - handoff for o, t in parts.items()}}
                               if parts else {})}
        why = (f"a hand-off costs {handoff * 1e3:.2f} ms and an expert call {call * 1e3:.2f} ms beyond its bytes; "
               f"~{misses:.2f} misses a layer take the device {misses * c.expert_bytes / gbs / 1e6:.2f} ms in place, "
               f"the host {whole * 1e3:.2f} ms an expert: share {share:.2f}"
               + ("" if share > 0 else " (the fixed costs exceed what the host would save; --cpu-share S forces it)"))
        return share, why

    def set_cpu_share(self, share: float) -> None:
        """Between steps: each step the host takes `share` of a layer's missed experts (rounded;
        `expert_cache.host_share`), first those e with floor((e + 1) * share) > floor(e * share) (spread over
        the ids); with `hybrid_split` (any bank format) each miss is split along its intermediate instead. Graphs
        captured before keep working for the per-expert split (tensors change in place); the column split
        is baked into captures: call `DecodeGraphs.reset()` after changing it. A share set this way stays:
        neither re-balanced nor tuned."""
        if self.host_decode is None:
            raise ValueError("hybrid decode is off (experts=gpu, no mapped caches, or a share of 0 at start)")
        self._rebalance, self.tuner, self.pending_share = False, None, None
        self._set_share(share)

    def _set_share(self, share: float) -> None:
        E = next(iter(self.caches.values())).host_w13.shape[0]
        cpu_class = torch.tensor([int((e + 1) * share) > int(e * share) for e in range(E)])
        for c in self.caches.values():
            c.use_host(self.host_decode, cpu_class, share, self.hybrid_split)
        self.cpu_share = self.stats.cpu_share = share
        order = cpu_class.nonzero().flatten().tolist() + (~cpu_class).nonzero().flatten().tolist()
        # int4: one copy of the codes, in the host kernel's layout, only where the device never reads a miss
        # in place (share 1: `host_share` sends every miss to the host)
        self._lay_host_experts(order if share >= 1 else [])
        # any miss may fall to the host at a share > 0: all are built, the first-chosen first; at share 0 none is
        # (the copy path builds a packed miss it sends to the host on its own: `HostExperts.build_later`; session 16,
        # Mixtral 32L int4: preparing all 256 at share 0 kept the host's cores busy for 40 s)
        self._prepare_host_experts(order if share > 0 else [])
        log.info("hybrid decode: the host computes a share %.2f of each layer's missed experts per step, "
                 "%d of %d experts first", share, int(cpu_class.sum()), E)

    def _lay_host_experts(self, experts: list[int]) -> None:
        """Int4 banks: `experts` keep one copy of their codes, in the host kernel's layout (`HostExperts.lay`;
        copies to the device re-lay on arrival; the caller makes sure the device never reads them in place);
        the others go back to the store's layout. The device is drained first: no copy or kernel reads the
        bytes while they move. (With 0 < share < 1 any miss may be read in place: int4 host experts then keep
        a re-laid copy each, TODO: a split that never sends a laid expert to the in-place kernel.)"""
        banks = [c.host_experts for c in self.caches.values()]
        if not any(he.can_lay for he in banks):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for he in banks:
            he.unlay(sorted(he.laid - set(experts)))
            he.lay(experts)

    def _prepare_host_experts(self, experts: list[int]) -> None:
        """Build the host kernels of `experts` in every layer on a background thread, so no decode step pays
        a first use (a copied int4 re-layout took 2 s for one Mixtral-sized expert on a loaded 2-core host;
        laid experts only convert their scales); a step that needs one first builds it itself (one build per
        expert: `HostExperts` locks each)."""
        # a split packed bank: the column kernels its decode steps use (the whole experts, for the copy path's
        # host misses, are built on first use)
        banks = [(c.host_experts, c.split_cols or 0) for c in self.caches.values()]
        stop = self._closing

        def run():  # one expert at a time, so `close()` ends it between two
            for he, cols in banks:
                for e in experts:
                    if stop.is_set():
                        return
                    he.prepare([e], cols)
        t = threading.Thread(target=run, name="ferry-host-experts-prepare", daemon=True)
        t.start()
        self._prepare_threads = [*(p for p in self._prepare_threads if p.is_alive()), t]

    def wait_host_builds(self, timeout: float | None = None) -> float:
        """Wait for the host kernels being built in the background (`_prepare_host_experts` after a share
        change, `HostExperts.build_later` after a step) to be done; returns the seconds waited. They share the
        host's cores with the steps: a benchmark that times steady-state decode calls this first (session 16:
        Mixtral 32L int4 at batch 16 ran its first setting 28% slower than its copy-only one while the column
        kernels of 256 experts were still being built)."""
        t0 = time.perf_counter()
        end = None if timeout is None else t0 + timeout
        for t in list(self._prepare_threads):
            t.join(None if end is None else max(0.0, end - time.perf_counter()))
        for c in self.caches.values():
            if c._host_experts is not None:
                c._host_experts.wait_built(None if end is None else max(0.0, end - time.perf_counter()))
        self._prepare_threads = [p for p in self._prepare_threads if p.is_alive()]
        return time.perf_counter() - t0

    @property
    def settling(self) -> bool:
        """Hybrid decode's share may still move: the re-balance has not run, or the share tuner has not settled,
        or a share they chose waits to be applied. A measurement of the engine as it serves once settled (`ferry
        plan --check`) decodes untimed until this is False."""
        return self.host_decode is not None and (self._rebalance is not False or self.tuner is not None) \
            or self.pending_share is not None

    @property
    def graphable(self) -> bool:
        """Decode steps can be CUDA-graphed: no streamed layer, every cached bank reads in place."""
        return self.streamer is None and all(c.mapped for c in self.caches.values())

    @property
    def graph_tokens(self) -> int | None:
        """The most tokens a graphed step may have (mapped caches copy larger steps), None: no limit."""
        return min((c.mapped_tokens for c in self.caches.values()), default=None)

    @property
    def _timed(self) -> bool:
        return self.device.type == "cuda" and not self.placement.fully_resident

    def before_step(self) -> None:
        """A step starts (the runner, before it queues anything): its device time is timed from here (CUDA, weights
        off the device: a resident model's steps time nothing)."""
        if self._timed:
            self.stats.begin_step(torch.cuda.current_stream(self.device))

    def after_step(self, step_s: float | None = None, tokens: int | None = None) -> None:
        """After every step (`step_s`: its wall time, for the per-step figures; `tokens`: its batch when it
        was a decode step of one token a sequence, for the share tuner)."""
        if self.tuner is not None:
            if self.host_decode is None:  # no hybrid decode: no share to tune (a step's time does not move with it)
                self.tuner = None
            else:
                self._tune(time.perf_counter(), tokens)
        if step_s is not None:
            self.stats.steps += 1
            self.stats.step_s += step_s
        if self._timed:
            self.stats.end_step(torch.cuda.current_stream(self.device))
            self.stats.collect()  # every step, whichever rank: the timed events never pile up
        if self.host_decode is not None:
            self.host_decode.check()
        if self.tally is not None:
            self.tally.after_step()

    def after_results(self) -> None:
        """Once a step's results are on the host: its routing counts have landed too (the slots follow them
        a step sooner than from `after_step` under async scheduling)."""
        self.stats.collect()
        if self.tally is not None:
            self.tally.after_results()
            self._maybe_rebalance()

    def _start_hybrid(self) -> None:
        from ferrylm.hw.cpu_binding import check_threads, worker_pool
        from ferrylm.offload.calibration import calibrate

        if self.device.type == "cuda":  # one worker (torch's intra-op threads inside) beside the GPU work
            check_threads(self.cpu_threads, self.expert_cpus, "--cpu-threads")  # (its CPUs: the node's, if bound)
            self.cpu_pool = worker_pool(self.expert_cpus, self.cpu_threads)
        else:  # the CPU engine computes experts on its own thread (bound by --numa-node, if at all)
            if self.expert_cpus:
                log.warning("--cpu-numa-node: the CPU engine computes experts on its engine thread; bind it "
                            "with --numa-node (the host tier's memory is bound)")
            if self.cpu_threads:
                check_threads(self.cpu_threads, None, "--cpu-threads")  # (this thread's CPUs)
                torch.set_num_threads(self.cpu_threads)
        first = next(iter(self.caches.values()))
        mapped = all(self.host.is_mapped(t) for t in first.host_parts())
        # on CUDA without --cpu-threads the worker takes the thread count that runs fastest beside copies
        choose = self.cpu_pool is not None and not self.cpu_threads
        args = (first.host_w13, first.host_w2, first.act, self.device, first.host_experts, mapped, choose)
        # measured on the thread that will compute the experts (its binding, its torch threads)
        costs, self.calibration = (self.cpu_pool.submit(calibrate, *args).result() if self.cpu_pool
                                   else calibrate(*args))
        self.costs = costs
        slotless = []
        for c in self.caches.values():
            c.cpu_mode, c.costs, c.cpu_pool = self.experts, costs, self.cpu_pool
            if not c.copy_slots:  # nothing to copy a miss into (`memory.size_memory` placed no
                c.cpu_mode = "cpu"  # slots under a tight budget): its copy-road misses run on the host
                slotless.append(c.layer)
        if slotless and self.experts != "cpu":  # (auto: the CPU engine's is "gpu" here)
            log.warning("%d MoE layer(s) have no free expert slot on the device (the budget leaves no room for "
                        "them): the misses they would copy in (prefill, large batches) run on the host's cores, as "
                        "with --experts cpu", len(slotless))

    def before_layer(self, i: int) -> None:
        if self.streamer is not None:
            self.streamer.before_layer(i)

    def after_layer(self, i: int) -> None:
        if self.streamer is not None:
            self.streamer.after_layer(i)

    @property
    def embed_device(self) -> torch.device:
        from ferrylm.layers.embedding import VocabEmbedding  # a Linear over the table (it may be packed)

        return next(m for m in self.model.modules() if isinstance(m, (nn.Embedding, VocabEmbedding))).weight.device

    def device_bytes(self) -> int:
        """Device bytes the weights take: resident parameters, stream buffers, expert slots."""
        total = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                    if self.tier_of_param.get(n, GPU) == GPU and not p.is_meta)
        if self.streamer is not None:
            total += self.streamer.bytes
        for c in self.caches.values():
            total += c.slot_bytes
        if self.pool is not None:
            total += self.pool.nbytes
        return total

    def close(self) -> None:
        """Release what the placement holds (idempotent; no step may run after it): the hybrid decode worker
        and the host-kernel build thread end, the host expert pool shuts down, the host tier's memory is
        unregistered, and the references to the model, its expert caches and stream buffers are dropped, so the
        device memory they hold goes back to the allocator once the caller drops its own. `stats` stay readable."""
        self._closing.set()
        if self.host_decode is not None:
            self.host_decode.close()
        if self.cpu_pool is not None:
            self.cpu_pool.shutdown()
        for t in self._prepare_threads:
            t.join()  # each at most one expert's kernel build away
        for c in self.caches.values():
            if c._host_experts is not None:
                c._host_experts.close()  # its background builds (`HostExperts.build_later`)
        if self.device.type == "cuda":  # no copy may still read the host tier when it is unregistered
            torch.cuda.synchronize(self.device)
        self.host.close()
        self.host_decode = self.cpu_pool = self.tally = self.streamer = None
        self.pool = self.staging = None  # (the staging slots hold their donor and linked caches)
        self._prepare_threads = []
        self.caches = {}
        self.model = None
        self.copy_stream = None
