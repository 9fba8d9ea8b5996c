"""Calibration for the hybrid cost model: measured on the machine that runs, cached per machine, shape and format.

Measures, for one expert of the bank as it is held (dense or packed: `offload/host_experts.HostExperts`, the
kernels the hybrid path runs):
- `copy_s`: seconds to copy its bytes to the device (pinned host -> device; a host memcpy on the CPU engine);
- `cpu_s`: the host's seconds to run it on 1, 4, 16, 64 and 256 tokens, as a step runs a few of them (`CYCLE`
  experts in one `HostExperts.outputs` call: one native call for them all where each takes one alone); one expert
  alone in a call (a layer's single miss) runs slower than this;
- `cpu_s_beside_copy`: the same at 1 token while another thread keeps copies running (host -> device, or a
  large memcpy on the CPU engine): the copies take memory bandwidth from the cores, and on the lent GPU host
  the packed kernels slow down most beside them (docs/benchmarks.md);
- `copy_s_beside_cpu`: the copy while the host computes experts;
- on CUDA with a mapped bank (`mapped`): `inplace_gbs` (and `inplace_gbs_beside_cpu`), the rate at which the
  fused kernel reads the expert in place over PCIe (`inplace_read_gbs`);
- with `choose_threads` (CUDA, no `--cpu-threads`): `threads`, the torch thread count (of N, N-1, N-2, N/2; after
  the host GEMM path is chosen, at N) at which the expert runs fastest beside copies, and the calling thread keeps
  it. Why: torch's CPU kernels split their work statically over an OpenMP team, so while another thread holds a
  core (the copy's or the engine's thread spinning in a CUDA sync) one team member waits for a scheduler tick and
  the whole call with it (measured on a loaded 2-core host: 0.16 ms on one thread, 8-16 ms on two, in steps of the 4 ms
  tick; docs/benchmarks.md's 16 ms collapse of the packed kernels beside a copy looks the same).
- a dense bf16 / fp16 bank: `dense_gemm`, the way `layers/cpu_experts` multiplies its weights (of
  `DENSE_GEMMS`: oneDNN's GEMM on torch's threads, its rows split over single-threaded workers, torch's own
  GEMV at 1 token), the one fastest at 1 token beside copies (`cpu_s_beside_copy_by_gemm`), and
  `dense_gemm_max_t`, the most tokens (of 2..64, alone: `cpu_s_by_gemm`) at which a split one still beats
  the plain GEMM (more take the plain one), by the path `dense_gemm_multi` where it is not the one-token
  winner ("native" on an AMX host can lose at one token and win at 2-64 on tiles): which wins depends on the machine
  (benchmarks/bench_host_gemv.py). Both are set in `layers/cpu_experts` (process-wide: every layer's host
  experts) before the figures above are taken, so they time the path the hybrid decode then runs, and set
  again from the cache. A per-channel int8 bank chooses `packed_gemm` (plain or split) the same way, a bank decoded
  in row blocks (nf4, fp8, group-wise int8) `row_blocks_gemm` (plain or split over the pool, native; fp8 also
  native-avx: at one token small fp8 experts can run faster on AVX512-BF16 than on tiles, which then take 2-64).
Each CPU figure cycles over a few experts, so the reads come from DRAM rather than the last-level cache.
The options of each choice (thread counts, GEMMs) are timed interleaved, one run of each per round, medians
(`_compare`): a burst of other work on the host then lands on all of them alike.
The result is cached in `$FERRYLM_CACHE_DIR` (default `~/.cache/ferrylm`) under a key of the machine (CPU
model, cores, threads, GPU, torch version), the expert's shape, dtype and format (and whether the in-place
rate was measured); a different machine, shape or format measures again. A corrupt cache file is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time

import torch

from ferrylm.files import write_atomic
from ferrylm.layers import cpu_experts, host_native
from ferrylm.offload.cost_model import Costs
from ferrylm.offload.host_experts import HostExperts

log = logging.getLogger(__name__)
TOKENS = (1, 4, 16, 64, 256)
"""Token counts an expert's host time is measured at (`cost_model.Costs.cpu_s` interpolates, and extrapolates from
the last two). 256: up to 64 tokens a big expert is still bound by its bytes on the host, and the line through 16
and 64 priced a prefill chunk's ~512 tokens an expert at 23 ms where the host, bound by its FLOPs there, takes
several times that: the copy road's split sent 32 experts of a 2k prefill to the host and ran 1786 tok/s against
2862 copying all (H200 host, Mixtral 16L bf16, session 19)."""
GEMM_TOKENS = (1, 2, 4, 8, 16, 32, 64)
"""Token counts at which a split dense GEMM is checked against the plain one (`dense_gemm_max_t`)."""
CYCLE = 4
"""Distinct experts each CPU figure cycles over."""
VERSION = 13  # 13: the cycle's experts timed as a step runs them (`HostExperts.outputs`: one native call for all
#   where each takes one alone); 12: fp8 row blocks race "native" (AMX tiles) against "native-avx" at one token;
#   11: fp8 banks' "native" row blocks run a kernel (before, the choice fell back to split); 10: bf16
#   "native" at 2-64 tokens on AMX tiles (its timings changed; races at 32 and 64 tokens)
"""Bumped when what is measured changes (older cache files are measured again)."""
KNOBS = (("dense_gemm", cpu_experts.DENSE_GEMMS), ("packed_gemm", cpu_experts.PACKED_GEMMS),
         ("row_blocks_gemm", cpu_experts.ROW_BLOCKS_GEMMS))
"""The host GEMM settings of `layers/cpu_experts` a calibration chooses (one per bank format) and its cache sets."""


def cache_dir() -> str:
    return os.environ.get("FERRYLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ferrylm")


def machine_key(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__}


def _timeit(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


SETTLE_S = 0.03
"""Seconds `_compare` waits before each timed run: a torch op run on the calling thread's OpenMP team leaves that
team spinning for a while after it (libgomp's default wait policy), and the spinners take cores from whatever runs
next: interleaved, a native run on the C pool right after oneDNN's paid for oneDNN's spinners (2-core box, a Mixtral
w13 at 2 tokens: 7.05 ms right after a parallel torch op, 5.25 after 30 ms of sleep, 5.15 with
OMP_WAIT_POLICY=PASSIVE). The engine runs one path throughout, so a race times each path settled."""


def _compare(options, select, fn, reps: int = 5) -> dict:
    """{option: median seconds of `fn()` after `select(option)`}, the options timed interleaved (one run of each
    per round, after a warm-up run of each), so a burst of other work on the host lands on all of them alike
    rather than on whichever was being timed (one after the other, a burst once turned a whole choice); each run
    after `SETTLE_S` of quiet."""
    times: dict = {o: [] for o in options}
    for r in range(reps + 1):
        for o in options:
            select(o)
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            fn()
            if r:
                times[o].append(time.perf_counter() - t)
    return {o: sorted(ts)[len(ts) // 2] for o, ts in times.items()}


class _Beside:
    """Runs `fn` over and over on another thread for the length of a `with` block (after one run)."""

    def __init__(self, fn):
        self.fn, self.stop, self.ran = fn, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ferry-calibration", daemon=True)

    def _loop(self):
        while not self.stop.is_set():
            self.fn()
            self.ran.set()

    def __enter__(self):
        self.thread.start()
        self.ran.wait()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _parts(side, e: int) -> list[torch.Tensor]:
    return [t[e] for t in (side.parts.values() if not isinstance(side, torch.Tensor) else (side,))]


def _copier(host_w13, host_w2, device: torch.device):
    """A function copying expert 0's bytes to the device (a fresh host buffer on the CPU engine), and
    waiting for them."""
    src = _parts(host_w13, 0) + _parts(host_w2, 0)
    if device.type == "cuda":
        dst = [torch.empty_like(t, device=device) for t in src]
        stream = torch.cuda.Stream(device)

        def copy():
            with torch.cuda.stream(stream):
                for d, t in zip(dst, src):
                    d.copy_(t, non_blocking=True)
            stream.synchronize()
    else:
        dst = [torch.empty_like(t) for t in src]

        def copy():
            for d, t in zip(dst, src):
                d.copy_(t)
    return copy


def inplace_read_gbs(host_w13, host_w2, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                     reps: int = 5, beside=None) -> float:
    """GB/s at which the fused kernel reads one expert in place from the mapped host bank at one token
    (CUDA only: the bank must be registered mapped, as the host tier does), optionally while `beside()`
    runs on another thread (host experts computing)."""
    from ferrylm.layers.fused_moe import WeightTable, expert_rows
    from ferrylm.offload.host_experts import expert_bytes

    E, H = host_w13.shape[0], host_w13.shape[2]
    tables = []
    for side in (host_w13, host_w2):
        parts = side.parts if not isinstance(side, torch.Tensor) else {"q": side}
        ptrs = {k: torch.tensor(WeightTable.addresses(t), dtype=torch.long, device=device) for k, t in parts.items()}
        tables.append(WeightTable(ptrs, side))
    x = torch.randn(1, H, dtype=dtype, device=device)
    w = torch.ones(1, 1, device=device)
    ids = [torch.tensor([[e % E]], device=device) for e in range(CYCLE)]

    def run():
        for i in ids:
            expert_rows(x, *tables, i, w)
        torch.cuda.synchronize(device)

    def timed():
        run()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) / len(ids))
        return sorted(times)[len(times) // 2]

    with torch.cuda.device(device):  # Triton launches on the current device: the caller may be a worker thread
        if beside is None:
            s = timed()
        else:
            with _Beside(beside):
                s = timed()
    return expert_bytes(host_w13, host_w2) / s / 1e9


def measure(host_w13, host_w2, act, device: torch.device, host_experts: HostExperts | None = None,
            mapped: bool = False, choose_threads: bool = False) -> dict:
    he = host_experts or HostExperts(host_w13, host_w2, act)
    E, H = host_w13.shape[0], host_w13.shape[2]
    cycle = list(range(min(CYCLE, E)))
    he.prepare(cycle)
    dtype = he.dense_dtype
    copy = _copier(host_w13, host_w2, device)
    copy_s = _timeit(copy)

    def run_experts(n: int):
        """A call running each of `cycle`'s experts on n tokens as a step's host experts run (`HostExperts.outputs`:
        one native call for them all where each takes one alone) (-> its time / len(cycle) is one expert's)."""
        x = torch.randn(n, H, dtype=dtype)
        rows = {e: torch.arange(n) for e in cycle}
        return lambda: he.outputs(x, rows)

    def cpu_time(n: int, reps: int = 3) -> float:
        return _timeit(run_experts(n), reps) / len(cycle)

    if device.type == "cuda":
        beside_copy = copy
    else:  # the CPU engine has no copy engine: a memcpy of a buffer larger than the caches stands in
        big = torch.empty(64 << 20, dtype=torch.uint8)
        big_dst = torch.empty_like(big)

        def beside_copy():
            big_dst.copy_(big)
    knob = None  # the host GEMM choice this bank has: (layers/cpu_experts' setting, its choices)
    if isinstance(host_w13, torch.Tensor) and dtype in (torch.bfloat16, torch.float16):
        knob = ("dense_gemm", cpu_experts.DENSE_GEMMS)
    elif isinstance(he.expert(cycle[0]).gate_up, cpu_experts.Int8Split):
        knob = ("packed_gemm", cpu_experts.PACKED_GEMMS)
    elif isinstance(he.expert(cycle[0]).gate_up, cpu_experts.RowBlocks):
        knob = ("row_blocks_gemm", cpu_experts.ROW_BLOCKS_GEMMS)
    by_gemm, by_tokens = {}, {}
    name = best = None
    fp8_rows = knob is not None and knob[0] == "row_blocks_gemm" and he.expert(cycle[0]).gate_up.fp8 is not None
    if knob:
        name, choices = knob[0], cpu_experts.usable(knob[1]) or ("plain",)
        if not fp8_rows:  # "native-avx" differs from "native" only for fp8 row blocks
            choices = tuple(g for g in choices if g != "native-avx")
        setattr(cpu_experts, f"{name}_max_t", max(GEMM_TOKENS))

        def use(g):
            setattr(cpu_experts, name, g)

        with _Beside(beside_copy):
            by_gemm = {g: s / len(cycle) for g, s in _compare(choices, use, run_experts(1)).items()}
        best = min(by_gemm, key=by_gemm.get)
        use(best)

    chosen = {}
    n = torch.get_num_threads()
    if choose_threads and n >= 4:  # with the GEMM path chosen: its chunks follow the count
        # half the cores too: the native NF4 kernel ran 5.0 ms an expert on 8 of the H200 host's 16, 6.8 on 16
        counts = sorted({n, n - 1, n - 2, n // 2}, reverse=True)
        with _Beside(copy):
            got = _compare(counts, torch.set_num_threads, run_experts(1))
        chosen = {str(t): s / len(cycle) for t, s in got.items()}
        torch.set_num_threads(int(min(chosen, key=chosen.get)))

    if knob:
        # 2..64 tokens: the one-token winner, and "native" on an AMX host (tiles from 2 tokens: it can lose the
        # one-token race and win here), against plain; the path that wins at 2 tokens is kept up to the most tokens
        # at which it still beats plain (`{name}_multi`, `{name}_max_t`; more take plain)
        cands = [best] if best != "plain" else []
        tiles = (name == "dense_gemm" and dtype == torch.bfloat16 and cpu_experts.use_amx(2)) or (
            fp8_rows and "native-avx" in choices)  # tiles from 2 tokens: "native" can lose at one and win here
        if tiles and "native" in choices and "native" not in cands:
            cands.append("native")
        max_t, multi = 1, None
        setattr(cpu_experts, f"{name}_multi", None)
        for n in GEMM_TOKENS[1:]:
            if not cands:
                break
            got = {g: sec / len(cycle) for g, sec in _compare(("plain", *cands), use, run_experts(n), reps=3).items()}
            for g, sec in got.items():
                by_tokens.setdefault(g, {})[str(n)] = sec
            win = min(cands, key=got.get)
            if got[win] >= got["plain"]:
                break
            max_t, multi, cands = n, win, [win]
        setattr(cpu_experts, name, best)
        setattr(cpu_experts, f"{name}_max_t", max_t)
        setattr(cpu_experts, f"{name}_multi", multi if multi != best else None)
    cpu = {str(n): cpu_time(n) for n in TOKENS}
    with _Beside(beside_copy):
        cpu_beside = {"1": cpu_time(1, reps=5)}
    x1 = torch.randn(1, H, dtype=dtype)
    run_cpu = lambda: he.expert(0)(x1)  # noqa: E731
    with _Beside(run_cpu):
        copy_beside = _timeit(copy, reps=5)
    out = {"copy_s": copy_s, "expert_bytes": he.expert_bytes, "format": he.format, "cpu_s": cpu,
           "cpu_s_beside_copy": cpu_beside, "copy_s_beside_cpu": copy_beside}
    if chosen:
        out.update(threads=torch.get_num_threads(), cpu_s_beside_copy_by_threads=chosen)
    if knob:
        name = knob[0]
        out.update({name: getattr(cpu_experts, name), f"{name}_max_t": getattr(cpu_experts, f"{name}_max_t"),
                    f"{name}_multi": getattr(cpu_experts, f"{name}_multi"),
                    "cpu_s_beside_copy_by_gemm": by_gemm, "cpu_s_by_gemm": by_tokens})
    if device.type == "cuda" and mapped:
        try:
            out["inplace_gbs"] = inplace_read_gbs(host_w13, host_w2, device)
            out["inplace_gbs_beside_cpu"] = inplace_read_gbs(host_w13, host_w2, device, beside=run_cpu)
        except Exception as e:  # a figure for the planner, never a reason not to start
            log.warning("could not measure the in-place read rate (%s)", str(e))  # no traceback kept
    return out


def _curve(points: dict):
    pts = sorted((int(n), s) for n, s in points.items())

    def f(n: int) -> float:  # piecewise linear in tokens, extrapolated from the last two points
        if len(pts) == 1:
            return pts[0][1] * max(n, 1)
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * max(n - n0, 0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (n - n1) / (n1 - n0)
    return f


def costs_from(m: dict) -> Costs:
    cpu_s = _curve(m["cpu_s"])
    beside = m.get("cpu_s_beside_copy", {}).get("1")
    factor = beside / cpu_s(1) if beside else 1.0  # the slowdown beside copies, applied at every token count
    return Costs(m["copy_s"], cpu_s, cpu_beside_factor=max(factor, 1.0), expert_bytes=m.get("expert_bytes", 0),
                 inplace_gbs=m.get("inplace_gbs_beside_cpu") or m.get("inplace_gbs"))


def calibrate(host_w13, host_w2, act, device: torch.device, host_experts: HostExperts | None = None,
              mapped: bool = False, choose_threads: bool = False) -> tuple[Costs, dict]:
    """Costs for this machine, expert shape and format, from the cache file when it matches, else measured.
    host_w13 / host_w2: the host bank (dense tensors or `ExpertWeights`); `host_experts` its `HostExperts`
    (built here if None); `mapped`: the bank is registered mapped (the in-place rate can be measured);
    `choose_threads`: pick torch's thread count beside copies (see the module docstring) and keep it on the
    calling thread (and for threads that start torch work after it)."""
    he = host_experts or HostExperts(host_w13, host_w2, act)
    key = {**machine_key(device), "shape": [list(host_w13.shape[1:]), list(host_w2.shape[1:])],
           "dtype": str(he.dense_dtype), "format": he.format, "version": VERSION,
           "inplace": mapped and device.type == "cuda",  # a cache made without the in-place rate lacks it
           "choose_threads": choose_threads,
           # a 2..64-token choice of "native" stands on AMX tiles: it does not hold where they stop running (or start)
           "amx": host_native.amx() and cpu_experts.native_amx}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"calibration-{digest}.json")
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") == key:
            if choose_threads and "threads" in data["measured"]:
                torch.set_num_threads(int(data["measured"]["threads"]))
            for name, choices in KNOBS:
                if data["measured"].get(name) in choices:
                    multi = data["measured"].get(f"{name}_multi")
                    setattr(cpu_experts, name, data["measured"][name])
                    setattr(cpu_experts, f"{name}_max_t", int(data["measured"][f"{name}_max_t"]))
                    setattr(cpu_experts, f"{name}_multi", multi if multi in choices else None)
            return costs_from(data["measured"]), data["measured"]
        log.warning("calibration cache %s was made on another machine or shape: measuring again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("calibration cache %s is unreadable (%s): measuring again", path, str(e))
    measured = measure(host_w13, host_w2, act, device, he, mapped, choose_threads)
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "measured": measured}, indent=1))  # never a half-written cache
    except OSError as e:
        log.warning("cannot write the calibration cache %s (%s)", path, str(e))
    log.info("calibrated (%s, %d threads, %s GEMM): expert copy %.2f ms, CPU expert %s ms, %.2f ms at 1 token "
             "beside copies", he.format, torch.get_num_threads(),
             next((measured[n] for n, _ in KNOBS if n in measured), "plain"),
             measured["copy_s"] * 1e3,
             {n: round(s * 1e3, 2) for n, s in measured["cpu_s"].items()},
             measured["cpu_s_beside_copy"]["1"] * 1e3)
    return costs_from(measured), measured
