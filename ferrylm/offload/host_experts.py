"""One layer's host-resident experts computed on the host's cores where they lie (no weight copies): the CPU
side of the hybrid path. `HostExperts(w13, w2, act)` wraps a host bank, in any format the engine holds it:
dense [E, 2I, H] / [E, H, I] tensors (bf16, fp16, fp32: computed in their own dtype, so an fp32 bank gives
exactly `layers/moe.expert_mlp`'s bits) or packed `layers/fused_moe.ExpertWeights` (int8, fp8, int4,
int4min, nf4). It builds one `layers/cpu_experts.HostExpert` per expert on first use (`prepare` builds
them ahead), over views of the bank's own bytes:
- int4 / int4min (rows a multiple of 16) -> `QuantizedTensor` views for qmatmul's `Int4PackCPU`, which
  re-lays the codes out in torch's CPU layout: a second copy of the expert's codes. `lay(experts)` avoids
  it: those experts' codes are re-laid in place in the bank itself (rows a multiple of 64) and computed by
  `layers/cpu_experts.Int4InPlace` (the same kernel, the same bits, one copy). The bank's bytes of a laid
  expert are then not the store's layout: whoever copies one to the device calls `arrived` on the copy
  (re-laid back there, in stream order), and the device must not read a laid expert in place (hybrid
  decode lays only the experts the host computes while they are not in a slot). No torch kernel reads the
  store's layout at the int4 kernel's speed (re-laying per call costs ~10x the matmul), hence the swap;
- int8 per channel -> `Int8PackCPU` on the bank's codes (only the scales are converted, to bf16);
- nf4, fp8, group-wise int8, odd-sized int4 -> `RowBlocks`: rows decoded a few MB at a time into bf16
  for the GEMM (fp8: exactly, by moving bits, the fp32 scale on the output; group-wise fp8 on the values).

`rows(x, ids, weights, out)` computes the weighted output of every assignment whose expert id is >= 0 in
`ids` (the caller marks the assignments it keeps with -1) into `out`'s rows, in the layout of
`layers/fused_moe.expert_rows` (row t * k + j for token t's j-th expert) with every other row 0, so the
device adds them to its own rows exactly. `rows(..., cols=c)` computes only the intermediate columns [c, I)
(hybrid decode's column split; the device computes [0, c)): dense banks through views, packed ones through
kernels over windows of their parts (gate rows [c, I), up rows [I + c, 2I), w2's K columns [c, I); c a
multiple of `split_unit`, so the window starts on a group). `outputs(x, rows)` gives each expert's unweighted rows
(the copy road's host experts). Both run the experts of a call that each run as one native call alone (dense bf16,
NF4, fp8 SiLU experts under "native"), two or more, as one native call (`layers/cpu_experts.native_batched_experts`:
the same bits). Its Python work grows with the assignments and the experts used, never with E. Thread-safe: each expert's kernels are built once, under that expert's own lock.
It knows nothing about caches, streams or which thread runs it. Shapes: T tokens, k experts a token,
H hidden, I the expert's intermediate size, E experts.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections import deque

import torch

from ferrylm.layers.cpu_experts import (HostExpert, Int4InPlace, RowBlocks, dense_linear, int4_from_cpu_layout_,
                                        int4_layout_matches, int4_to_cpu_layout_, native_expert, native_expert_fits,
                                        native_experts, native_packed_experts, split_pool)
from ferrylm.layers import cpu_experts
from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.layers.qmatmul import QuantKernel
from ferrylm.weights import quant as Q


def bank_format(side) -> str:
    """The format a bank side is held in: a dtype name ("bfloat16") or a packed format and group ("int4min/32")."""
    if isinstance(side, torch.Tensor):
        return str(side.dtype).removeprefix("torch.")
    return f"{side.fmt}/{side.group}"


def expert_bytes(w13, w2) -> int:
    """Bytes one expert holds in the bank (all parts of both sides): what a copy moves."""
    def parts(side):
        return side.parts.values() if not isinstance(side, torch.Tensor) else (side,)
    return sum(t[0].numel() * t.element_size() for side in (w13, w2) for t in parts(side))


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def fp8_to_bf16(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) -> the same values in bf16, exactly, by moving bits: s eeee mmm lands in bf16's
    sign, low exponent and high mantissa bits (s000 eeee mmm0 000 as int16), which reads as the value times
    2^-120 (subnormals included), so one power-of-two multiply finishes it. ~15x faster than torch's fp8
    cast on the CPU. The two NaN codes (never produced by quantize_fp8) read as +-480."""
    t = q.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..8 copy s
    t.bitwise_left_shift_(4).bitwise_and_(0x87F0 - 0x10000)  # keep s (bit 15) and eeeemmm (bits 10..4)
    return t.view(torch.bfloat16).mul_(2.0 ** 120)


def side_kernel(side, e: int, laid: bool = False):
    """Expert e of one bank side as what `HostExpert` takes: a dense [N, K] view, a `QuantizedTensor` over
    views of the packed parts (formats with a qmatmul CPU kernel), or a `RowBlocks` kernel; `laid`: int4
    codes already in torch's CPU layout in the bank (an `Int4InPlace` kernel over them)."""
    if isinstance(side, torch.Tensor):
        return side[e]
    _, N, K = side.shape
    fmt, gs = side.fmt, side.group
    q, s = side.parts["q"][e], side.parts["scale"][e]  # q: [N, K] or [N, K/2]; s: [N, G]
    if fmt == "int8" and gs == K:
        return Q.QuantizedTensor("int8", (N, K), {"q": q, "scale": s[:, 0]}, {}, torch.bfloat16)
    if fmt in ("int4", "int4min") and N % 16 == 0:
        parts = {"q": q, "scale": s, **({"min": side.parts["min"][e]} if fmt == "int4min" else {})}
        zero = "min" if fmt == "int4min" else "sym"
        qt = Q.QuantizedTensor("int4", (N, K), parts, {"group_size": gs, "zero": zero}, torch.bfloat16)
        return Int4InPlace(qt, q) if laid else qt
    native_fp8 = None
    if fmt == "fp8" and q.stride(-1) == 1 and K % 32 == 0 and gs % 32 == 0:  # what the native fp8 GEMV reads
        native_fp8 = (q, s if s.dtype == torch.float32 and s.stride(-1) == 1 else s.float().contiguous(), gs)
    if fmt == "fp8" and gs == K:  # per channel: e4m3 -> bf16 exactly (`fp8_to_bf16`); the scale goes on the output
        return RowBlocks((N, K), lambda a, c: fp8_to_bf16(q[a:a + c]), _nbytes(q, s), out_scale=s[:, 0].float(),
                         fp8=native_fp8)
    m = side.parts.get("min")
    m = m[e] if m is not None else None

    def decode(a: int, c: int) -> torch.Tensor:
        # rows [a, a + c) -> [c, K] bf16, the values `weights/quant.py`'s dequantizers give (fp32, then rounded)
        if fmt == "int8":  # group-wise: w = d * q
            w = q[a:a + c].float().view(c, -1, gs).mul_(s[a:a + c].float()[..., None])
        elif fmt == "fp8":  # group-wise (block-wise FP8 checkpoints): e4m3 -> bf16 exactly, then the group's scale
            w = fp8_to_bf16(q[a:a + c]).float().view(c, -1, gs).mul_(s[a:a + c].float()[..., None])
        elif fmt == "nf4":  # a byte -> its two levels as one 8-byte word; index_select takes int32 indices
            words = Q._NF4_PAIR_WORDS.index_select(0, q[a:a + c].reshape(-1).int())  # [c * K/2] fp64 pairs
            w = words.view(torch.float32).view(c, -1, gs).mul_(s[a:a + c].float()[..., None])
        elif fmt in ("int4", "int4min"):
            w = Q.unpack_nibbles(q[a:a + c]).float().view(c, -1, gs)  # [c, G, gs]
            d = s[a:a + c].float()[..., None]
            w = w.sub_(8).mul_(d) if fmt == "int4" else w.mul_(d).add_(m[a:a + c].float()[..., None])
        else:
            raise ValueError(f"host experts cannot read the {fmt!r} expert format")
        return w.view(c, K).to(torch.bfloat16)

    nf4 = None
    if fmt == "nf4" and q.stride(-1) == 1 and K % gs == 0 and gs % 32 == 0:  # what the native NF4 GEMV reads
        s32 = s if s.dtype == torch.float32 and s.stride(-1) == 1 else s.float().contiguous()
        nf4 = (q, s32, gs)
    return RowBlocks((N, K), decode, _nbytes(*(t[e] for t in side.parts.values())), nf4=nf4, fp8=native_fp8)


PACKED_HOST_FORMATS = ("int8", "fp8", "int4", "int4min", "nf4")
"""The packed formats `side_kernel` computes (all of `layers/fused_moe.FORMATS` but dense)."""


def _matmul(w):
    """What `side_kernel` gives -> a callable x [T, K] -> [T, N] (a packed `QuantizedTensor` gets qmatmul's
    CPU kernel for it)."""
    return QuantKernel.for_tensor(w) if isinstance(w, Q.QuantizedTensor) else w


def _window(side, e: int, r0: int, r1: int, k0: int) -> ExpertWeights:
    """Rows [r0, r1) and K columns [k0, K) of packed expert e, as a bank of one over views of its parts
    (k0 a multiple of the group along K; a per-channel side stays per channel)."""
    _, N, K = side.shape
    grouped = side.group < K
    per_byte = 2 if side.fmt in ("int4", "int4min", "nf4") else 1
    if grouped and k0 % side.group or k0 % per_byte:
        raise ValueError(f"column {k0} splits a group of {side.group} ({side.fmt})")
    s0 = k0 // side.group if grouped else 0
    p = {name: t[e:e + 1, r0:r1, (k0 // per_byte if name == "q" else s0):] for name, t in side.parts.items()}
    return ExpertWeights(side.fmt, (1, r1 - r0, K - k0), side.group if grouped else K - k0, p["q"], p["scale"],
                         p.get("min"))


def _column_window_kernel(w2, e: int, c: int):
    """w2's K columns [c, I) of expert e, all rows: a strided window of each row. Per-channel int8 and fp8
    decode exactly to bf16 with the fp32 scale on the output (qmatmul's int8 kernel wants contiguous rows)."""
    win = _window(w2, e, 0, w2.shape[1], c)
    if w2.fmt == "int8" and win.group == win.shape[2]:
        q, s = win.parts["q"][0], win.parts["scale"][0]  # [H, I - c] int8 (strided), [H, 1]
        return RowBlocks(tuple(win.shape[1:]), lambda a, n: q[a:a + n].to(torch.bfloat16), _nbytes(q, s),
                         out_scale=s[:, 0].float())
    return side_kernel(win, 0)


class HostExperts:
    def __init__(self, w13, w2, act):
        """w13: [E, 2I, H], w2: [E, H, I], dense tensors or `ExpertWeights` of one format; `act` the gate's
        activation. A dense bank computes in its own dtype; a packed one with bf16 activations."""
        if isinstance(w13, torch.Tensor) != isinstance(w2, torch.Tensor):
            raise ValueError("host experts: w13 and w2 must both be dense or both packed")
        self.w13, self.w2, self.act = w13, w2, act
        self.num_experts = w13.shape[0]
        self.format = bank_format(w13)
        """The bank's format ("bfloat16", "float32", "int4min/32", "nf4/64", ...)."""
        self.dense_dtype = w13.dtype if isinstance(w13, torch.Tensor) else torch.bfloat16
        self.expert_bytes = expert_bytes(w13, w2)
        """Bytes of one expert as the bank holds it."""
        self._experts: list[HostExpert | None] = [None] * self.num_experts
        # one lock per expert: a build happens once even if two threads ask for it, and a slow build (int4's
        # re-layout, a background `prepare`) never stalls a thread that wants another expert
        self._locks = [threading.Lock() for _ in range(self.num_experts)]
        self._split: dict[int, tuple] = {}  # expert -> (c, its column kernels): `_column_expert`
        self.laid: set[int] = set()
        """Experts whose int4 codes lie in the bank in torch's CPU layout (`lay`)."""
        self._queued: deque[int] = deque()  # `build_later`'s experts, built in order by `_builder`
        self._queued_set: set[int] = set()
        self._queue_lock = threading.Lock()
        self._builder: concurrent.futures.Future | None = None  # `_build_queued` running on split_pool(1)
        self._stop = threading.Event()

    @property
    def can_lay(self) -> bool:
        """An int4 bank whose sides' rows are whole blocks of torch's CPU layout on this build."""
        sides = (self.w13, self.w2)
        return all(isinstance(s, ExpertWeights) and s.fmt in ("int4", "int4min") and int4_layout_matches(s.shape[1])
                   for s in sides)

    def lay(self, experts) -> None:
        """Re-lay `experts`' codes in place into torch's CPU layout (no-op where `can_lay` is false or already
        laid). The caller makes sure nothing reads those bytes meanwhile (no copy in flight, no kernel
        reading them in place); their kernels are built again over the bank."""
        if not self.can_lay:
            return
        for e in experts:
            with self._locks[e]:
                if e not in self.laid:
                    for side in (self.w13, self.w2):
                        int4_to_cpu_layout_(side.parts["q"][e])
                    self.laid.add(e)
                    self._experts[e] = None

    def unlay(self, experts) -> None:
        """Back to the store's layout (the inverse of `lay`, under the same care)."""
        for e in experts:
            with self._locks[e]:
                if e in self.laid:
                    for side in (self.w13, self.w2):
                        int4_from_cpu_layout_(side.parts["q"][e])
                    self.laid.discard(e)
                    self._experts[e] = None

    def arrived(self, dst, s: int, e: int) -> None:
        """Slot s of `dst` (a bank side's copy target, any device) just received expert e: if e is laid,
        re-lay the copy back into the store's layout there (enqueue it on the stream that copied)."""
        if e in self.laid:
            int4_from_cpu_layout_(dst.parts["q"][s])

    def expert(self, e: int) -> HostExpert:
        h = self._experts[e]  # published whole (one list store) once built: readers need no lock
        if h is None:
            with self._locks[e]:
                h = self._experts[e]
                if h is None:
                    laid = e in self.laid
                    h = self._experts[e] = HostExpert(side_kernel(self.w13, e, laid), side_kernel(self.w2, e, laid),
                                                      self.act, dense_dtype=self.dense_dtype)
        return h

    def build_later(self, experts) -> None:
        """Build the whole-expert kernels of `experts` in the background, in order, each once (an expert already
        built or queued is skipped), on the single-threaded worker of `layers/cpu_experts.split_pool(1)`: a
        build must not take the cores the steps use (session 16, Mixtral 32L int4 at batch 16: builds on torch's
        16 threads beside the steps, 145 tok/s against 237 copying alone); `close()` ends it between two builds.
        What a step that found them unbuilt asks for (`CachedExperts._plan`: it copies them meanwhile)."""
        with self._queue_lock:
            if self._stop.is_set():
                return
            for e in experts:
                if self._experts[e] is None and e not in self._queued_set:
                    self._queued.append(e)
                    self._queued_set.add(e)
            if self._queued and self._builder is None:
                self._builder = split_pool(1).submit(self._build_queued)

    def _build_queued(self) -> None:
        while True:
            with self._queue_lock:
                if self._stop.is_set() or not self._queued:
                    self._builder = None
                    return
                e = self._queued.popleft()
            self.expert(e)
            with self._queue_lock:
                self._queued_set.discard(e)

    def close(self) -> None:
        """End `build_later`'s builds (after the one in progress, if any); queued builds are dropped."""
        with self._queue_lock:
            self._stop.set()
            f, self._queued = self._builder, deque()
            self._queued_set.clear()
        if f is not None:
            concurrent.futures.wait([f])

    def wait_built(self, timeout: float | None = None) -> bool:
        """Wait until `build_later`'s queue is empty and its builds done (True), or `timeout` seconds (False)."""
        with self._queue_lock:
            f = self._builder
        if f is not None:
            done, _ = concurrent.futures.wait([f], timeout)
            return bool(done)
        return True

    def built(self, e: int) -> bool:
        """Whether expert e's whole-expert kernels exist: always for a dense bank (views, nothing to build);
        for a packed one once `expert(e)` or `prepare` ran (int4's re-pack costs ~100 ms a Mixtral expert on the
        H200 host, fifty times its copy: a step should not pay it, `CachedExperts._plan`)."""
        return isinstance(self.w13, torch.Tensor) or self._experts[e] is not None

    def prepare(self, experts=None, cols: int = 0) -> None:
        """Build the kernels of `experts` (default all) now, so no step pays for a first use; with `cols` > 0
        (a packed bank split there) their column kernels instead (`rows(..., cols)` uses only those)."""
        split = cols and not isinstance(self.w13, torch.Tensor) and cols < self.w2.shape[2]
        for e in range(self.num_experts) if experts is None else experts:
            if split:
                self._column_expert(int(e), cols)
            else:
                self.expert(int(e))

    @property
    def splittable(self) -> bool:
        """Experts can be split along their intermediate (`rows(..., cols=c)`): every bank format."""
        return isinstance(self.w13, torch.Tensor) or self.w13.fmt in PACKED_HOST_FORMATS

    @property
    def split_unit(self) -> int:
        """What a split column c is a multiple of: 128 (the device kernels' K tiles) and w2's group along I
        (the host's columns [c, I) then start on a group: scales and codes are sliced, never re-grouped)."""
        g = 1 if isinstance(self.w2, torch.Tensor) or self.w2.group >= self.w2.shape[2] else self.w2.group
        return math.lcm(128, g)

    def _columns(self, e: int, x: torch.Tensor, c: int) -> torch.Tensor:
        """Expert e on the intermediate columns [c, I) only: [n, H] (the device computes [0, c) and adds).
        Views of the bank's rows; the strided w2 view costs BLAS nothing (its rows keep their stride); each
        GEMM by the path `layers/cpu_experts.dense_gemm` names (`dense_linear`), as whole experts are, or (bf16
        SiLU under "native") the whole window in one native call (`cpu_experts.native_expert`).
        Packed banks: kernels over windows of the packed parts (`_column_expert`), bf16 activations; an fp8 or NF4
        SiLU expert under "native" in one native call over the window (`HostExpert.window`)."""
        if not isinstance(self.w13, torch.Tensor):
            # fp8 / NF4 SiLU under "native": the window in one native call over the whole expert's codes (their
            # kernels are views of the bank: building the whole expert copies nothing, where int4's would copy)
            whole = self.expert(e) if self.format.split("/")[0] in ("fp8", "nf4") else None
            if whole is not None and whole.window_fits(x, c):
                return whole.window(x, c).to(x.dtype)
            gate, up, down = self._column_expert(e, c)
            xb = x.to(torch.bfloat16)
            return down(self.act(gate(xb)).mul_(up(xb)))
        I = self.w2.shape[2]
        w13, w2 = self.w13[e], self.w2[e]  # [2I, H], [H, I]
        xb = x.to(w13.dtype)
        if native_expert_fits(xb, w13, w2, self.act, c):  # one native call: no torch op between the GEMVs
            return native_expert(xb, w13, w2, c)
        mid = self.act(dense_linear(xb, w13[c:I])).mul_(dense_linear(xb, w13[I + c:]))  # [n, I - c]
        return dense_linear(mid, w2[:, c:])

    def _column_expert(self, e: int, c: int):
        """(gate, up, down) matmuls of packed expert e on columns [c, I): gate rows [c, I), up rows [I + c, 2I)
        of w13 and w2's K columns [c, I), each the kernel `side_kernel` picks for that window (int8 per channel:
        qmatmul's kernel on the row windows, the column window exactly in bf16 with the scale on the output;
        int4: `Int4PackCPU`, which keeps its own copy of the window's codes; nf4, fp8, group-wise int8:
        `RowBlocks` decoding only the window). Built once per (expert, c), under the expert's lock; a new c
        replaces the expert's kernels for the old one (int4's hold a copy of the window's codes)."""
        got = self._split.get(e)
        if got is None or got[0] != c:
            with self._locks[e]:
                got = self._split.get(e)
                if got is None or got[0] != c:
                    if e in self.laid:  # the device reads a split expert's columns [0, c) in place
                        raise ValueError(f"expert {e} is laid out for the host kernel: it cannot be split")
                    I = self.w2.shape[2]
                    if c % self.split_unit or not 0 < c < I:
                        raise ValueError(f"split column {c} of {I}: a multiple of {self.split_unit} in (0, I)")
                    gate, up = (_matmul(side_kernel(_window(self.w13, e, r, r + I - c, 0), 0)) for r in (c, I + c))
                    got = self._split[e] = (c, (gate, up, _matmul(_column_window_kernel(self.w2, e, c))))
        return got[1]

    def _native_batch(self, x: torch.Tensor, counts: dict[int, int], cols: int) -> list[int]:
        """The experts of `counts` (expert -> its tokens) that run together in one native call (`_batched`): each one
        that would run as one native call alone at its token count (dense bf16: `native_expert_fits`; NF4, fp8:
        `HostExpert.window_fits`), where there are `cpu_experts.native_batch_min` of them (else none)."""
        if not cpu_experts.native_batched_experts or x.dtype != torch.bfloat16 or not counts:
            return []
        fits = {}
        if isinstance(self.w13, torch.Tensor):
            w13, w2 = self.w13[0], self.w2[0]
            for n in set(counts.values()):
                fits[n] = native_expert_fits(x[:1].expand(n, -1), w13, w2, self.act, cols)
        elif self.w13.fmt in ("nf4", "fp8"):  # (their kernels are views of the bank: building them copies nothing)
            first = self.expert(next(iter(counts)))
            for n in set(counts.values()):
                fits[n] = first.window_fits(x[:1].expand(n, -1), cols)
        else:
            return []
        got = [e for e, n in counts.items() if fits[n]]
        return got if len(got) >= cpu_experts.native_batch_min else []

    def _batched(self, x: torch.Tensor, tokens: list[int], experts: list[int], cols: int) -> torch.Tensor:
        """`experts` (from `_native_batch`) on x's rows, expert i's `tokens[i]` rows after expert i - 1's, in one native
        call: [sum(tokens), H] bf16, unweighted."""
        if isinstance(self.w13, torch.Tensor):
            return native_experts(x, tokens, [self.w13[e] for e in experts], [self.w2[e] for e in experts], cols)
        return native_packed_experts(x, tokens, [self.expert(e) for e in experts], cols)

    def outputs(self, x: torch.Tensor, rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Expert e of `rows` (expert -> index tensor of x's rows) on its rows of x, unweighted: {e: [n, H] in x's
        dtype}, as `expert(e)(x[rows[e]])` gives it; the experts that each take one native call take one together
        (`_batched`), the rest theirs."""
        batched = self._native_batch(x, {e: len(r) for e, r in rows.items()}, 0)
        got = {}
        if batched:
            counts = [len(rows[e]) for e in batched]
            y = self._batched(x.index_select(0, torch.cat([rows[e] for e in batched])), counts, batched, 0)
            got = dict(zip(batched, y.split(counts)))
        for e, r in rows.items():
            if e not in got:
                got[e] = self.expert(e)(x[r])
        return got

    def rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
             cols: int = 0) -> int:
        """x: [T, H]; ids, weights: [T, k] (ids -1 where another side computes); out: [>= T * k, H], written
        in rows [0, T * k). With `cols` > 0 (any bank format; a multiple of `split_unit`), each expert on its
        intermediate columns [cols, I) only (`layers/fused_moe.expert_rows(..., inter=cols)` computes the rest;
        cols >= I: nothing). Returns the number of experts run."""
        T, k = ids.shape
        run = (lambda e, xs: self._columns(e, xs, cols)) if cols else (lambda e, xs: self.expert(e)(xs))
        out[:T * k].zero_()
        if cols >= self.w2.shape[2]:  # the device computes every column
            return 0
        groups: dict[int, list[int]] = {}  # expert -> its assignment rows, ascending
        for a, e in enumerate(ids.reshape(-1).tolist()):
            if e >= 0:
                groups.setdefault(e, []).append(a)
        wflat = weights.reshape(-1)  # [T * k]
        batched = self._native_batch(x, {e: len(a) for e, a in groups.items()}, cols)
        if batched:  # one native call for these experts (`cpu_experts.native_batched_experts`): the same bits
            rows_of = [groups.pop(e) for e in batched]
            idx = torch.tensor([i for r in rows_of for i in r])  # their assignment rows, expert by expert
            y = self._batched(x.index_select(0, idx // k), [len(r) for r in rows_of], batched, cols)  # [len(idx), H]
            out.index_copy_(0, idx, torch.mul(y, wflat.index_select(0, idx).float()[:, None]).to(out.dtype))
        for e, a in groups.items():
            if len(a) == 1:  # decode: views, no index tensors
                i = a[0]
                y = run(e, x[i // k:i // k + 1])  # [1, H]
                out[i:i + 1] = y.float().mul_(wflat[i].float())
            else:
                idx = torch.tensor(a)
                y = run(e, x.index_select(0, idx // k))  # [n, H]
                out.index_copy_(0, idx, torch.mul(y, wflat.index_select(0, idx).float()[:, None]).to(out.dtype))
        return len(groups) + len(batched)
