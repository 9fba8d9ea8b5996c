"""Sampler: one step's logits in, one token per sequence out (plus logprobs when a row asks).

Owns vLLM's per-token sampling semantics, batched and vectorised, on whatever device the logits live:
min_tokens masking of stop ids, repetition / presence / frequency penalties, temperature, min-p, top-k,
top-p, greedy and random sampling, per-request seeds, `logit_bias`, and an optional allowed-token bitmask
(structured outputs: the grammar engine fills it, the sampler only applies it). Each row comes as a plain
`SamplingRow` (params, token ids, prompt length; the engine's `Sequence` reads the same way): it knows
nothing about sequences, tokenizers, grammars, stop strings, scheduling or when a sequence finishes.

`sampler(logits, rows)` returns host lists (`SamplerOutput`); `sampler(logits, rows, allowed, True)`
returns a `SampledTokens` whose tensors stay on the device, so the engine can copy them down behind an
event and feed the ids to the next step without a host round trip (async scheduling). The per-row tensors
(temperature, top-k, top-p, min-p, which rows are random) are built once per batch membership, not
per step.

Order, per row (vLLM v1's):
  1. fp32 copy of the logits; rows below min_tokens get their eos and stop token ids masked; logit_bias is
     added; tokens outside a row's allowed bitmask get -inf.
  2. Penalties: repetition over prompt + output tokens, presence and frequency over output tokens.
     These are the "processed" logits: greedy rows take their argmax, and logprobs are the
     log_softmax of them (after penalties, before temperature / min-p / top-k / top-p; vLLM's default
     "raw" logprobs come before penalties).
  3. Random rows: divide by temperature, min-p (relative to the max prob, on the full distribution),
     top-k, top-p (renormalised after top-k, at least one token kept), softmax, then the exponential
     race `argmax(probs / q)`, `q ~ Exp(1)`.

Logprobs are finite: a token the processed logits rule out (-inf, or NaN from degenerate values) reports
-9999.0, as vLLM does, so the JSON a server builds from them is always valid.

Seeds: a seeded row draws its `q` from a generator re-seeded from (seed, number of tokens it has
generated), so its token depends on nothing but its own logits, params and position in its own output:
not on its neighbours, its batch row, preemption or which sampler instance runs it. Unseeded rows share
one generator per device, seeded from the constructor's `seed`, and are drawn together.

Dimension letters: B = rows in the batch, R = rows sampled at random, V = vocabulary,
L = longest token list among the rows that use a penalty, N = top-n logprobs.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ferrylm.layers.transfer import to_device
from ferrylm.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
MIN_LOGPROB = -9999.0
"""Reported for tokens whose logprob is -inf or NaN (JSON has no infinities)."""


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row: its params and its tokens so far."""

    params: SamplingParams
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    num_prompt_tokens: int
    seq_id: int = -1
    """Whose row this is, for the caller's bookkeeping; the sampler never reads it."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[dict[int, float] | None] | None
    """Per row {token: logprob} for the sampled token and the top-n, None for rows that did not ask;
    None altogether when no row asked."""


def uses_penalties(p: SamplingParams) -> bool:
    """Repetition, presence or frequency penalty: the row's logits depend on its tokens so far."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _pad_ids(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Token lists -> [B, L] long tensor padded with `pad` (ids >= pad are folded into it too)."""
    width = max((len(x) for x in lists), default=0)
    buf = array.array("q")  # ~2x faster than torch.tensor over nested lists for long prompts
    for x in lists:
        buf.extend(x)
        buf.extend(array.array("q", [pad]) * (width - len(x)))
    ids = torch.frombuffer(buf, dtype=torch.long).clone() if buf else torch.empty(0, dtype=torch.long)
    ids = ids.reshape(len(lists), width)  # [B, L]
    return ids.clamp_(0, pad).to(device, non_blocking=True)


def seed_for_step(seed: int, step: int) -> int:
    """Mix a request seed and the output position into one 63-bit generator seed (splitmix64)."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def apply_min_tokens(logits: torch.Tensor, seqs: list[SamplingRow], eos_token_ids: Iterable[int]) -> torch.Tensor:
    """In place: -inf on eos (unless ignore_eos) and stop token ids for rows below min_tokens."""
    # logits: [B, V]
    V = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(eos_token_ids)
        for t in ids:
            if 0 <= t < V:
                rows.append(i)
                cols.append(t)
    if rows:
        logits[to_device(rows, logits.device), to_device(cols, logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """In place: repetition penalty over prompt + output tokens, presence / frequency over output tokens."""
    # logits: [B, V] fp32
    B, V = logits.shape
    dev = logits.device
    params = [s.params for s in seqs]
    use = [uses_penalties(p) for p in params]

    if any(p.repetition_penalty != 1.0 for p in params):
        ids = _pad_ids([s.token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)], V, dev)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]  # [B, V]
        rep = to_device([p.repetition_penalty for p in params], dev, torch.float32)[:, None]  # [B, 1]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        out = [s.output_token_ids if u else [] for s, u in zip(seqs, use)]
        ids = _pad_ids(out, V, dev)  # [B, L]
        counts = torch.zeros(B, V + 1, dtype=torch.float32, device=dev)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :V]  # [B, V]
        pres = to_device([p.presence_penalty for p in params], dev, torch.float32)[:, None]  # [B, 1]
        freq = to_device([p.frequency_penalty for p in params], dev, torch.float32)[:, None]  # [B, 1]
        logits -= freq * counts + pres * (counts > 0)
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """In place: add each row's {token id: bias} (ids outside the vocabulary were refused at validation)."""
    # logits: [B, V]
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for t, b in (s.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(t)
            vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_((to_device(rows, dev), to_device(cols, dev)), to_device(vals, dev, logits.dtype),
                          accumulate=True)
    return logits


def apply_allowed_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: -inf on tokens whose bit is 0 in `bitmask`, for the given rows (bit t%32 of word t//32)."""
    # logits: [B, V]; rows: [M] long; bitmask: [M, W] int32, W = ceil(V / 32)
    V, dev = logits.shape[1], logits.device
    bitmask = bitmask.to(dev, non_blocking=True)  # the packed mask crosses to the device, 32x smaller than [M, V]
    rows = rows.to(dev, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :V]  # [M, V]
    if allowed.shape[1] < V:  # the grammar's vocabulary is shorter than the model's: the rest is padding
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    if rows.numel() == logits.shape[0]:  # every row constrained (rows are in order): no gather / scatter
        return logits.masked_fill_(~allowed, float("-inf"))
    sub = logits[rows]  # [M, V]
    logits[rows] = sub.masked_fill_(~allowed, float("-inf"))
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """-inf outside each row's top-k, then outside its nucleus (top-p of the renormalised top-k).

    Ties with the k-th value survive top-k; the most likely token always survives top-p.
    """
    # logits: [R, V]; top_k: [R] long in [1, V]; top_p: [R] float in (0, 1]
    V = logits.shape[1]
    x_sort, idx = logits.sort(dim=-1)  # ascending, [R, V]
    if top_k is not None:
        kth = x_sort.gather(1, (V - top_k).unsqueeze(1))  # [R, 1]
        x_sort.masked_fill_(x_sort < kth, float("-inf"))
    if top_p is not None:
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        x_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, x_sort)


@dataclass
class FilterTensors:
    """The per-row knobs of `filter_logits` as device tensors (None: no row uses that filter)."""

    temperature: torch.Tensor
    """[R] fp32 (1 for greedy rows)."""
    min_p: torch.Tensor | None
    """[R, 1] fp32."""
    top_k: torch.Tensor | None
    """[R] long in [1, V]."""
    top_p: torch.Tensor | None
    """[R] fp32 in (0, 1]."""

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> "FilterTensors":
        V, f32 = vocab_size, torch.float32
        temp = to_device([p.temperature if not p.greedy else 1.0 for p in params], device, f32)
        min_p = to_device([p.min_p for p in params], device, f32)[:, None] \
            if any(p.min_p > 0 for p in params) else None  # [R, 1]
        top_k = to_device([p.top_k if 0 < p.top_k < V else V for p in params], device) \
            if any(0 < p.top_k < V for p in params) else None
        top_p = to_device([p.top_p for p in params], device, f32) \
            if any(p.top_p < 1.0 for p in params) else None
        return cls(temp, min_p, top_k, top_p)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams], knobs: FilterTensors | None = None) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p for rows sampled at random; returns a new tensor.

    softmax of the result is the distribution each row samples from. `knobs`: the rows' tensors, built
    from `params` when not given.
    """
    # logits: [R, V] fp32 processed logits
    if knobs is None:
        knobs = FilterTensors.build(params, logits.shape[1], logits.device)
    x = logits / knobs.temperature[:, None]  # [R, V]
    if knobs.min_p is not None:
        probs = x.softmax(dim=-1)
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * knobs.min_p, float("-inf"))
    if knobs.top_k is not None or knobs.top_p is not None:
        x = apply_top_k_top_p(x, knobs.top_k, knobs.top_p)
    return x


class _BatchPlan:
    """What one batch membership (the same rows, in order, with the same params) needs from the sampler,
    worked out once and reused until the membership changes."""

    def __init__(self, seqs: list, vocab_size: int, device: torch.device):
        params = [s.params for s in seqs]
        self.params = params  # held so the ids in the key stay these objects'
        self.key = tuple(map(id, params))
        self.want_lp = any(p.logprobs is not None for p in params)
        self.penalties = any(uses_penalties(p) for p in params)
        self.min_rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        self.plain_greedy = (all(p.greedy and not p.logit_bias for p in params) and not self.want_lp
                             and not self.penalties)
        self.rand = [i for i, p in enumerate(params) if not p.greedy]
        rp = [params[i] for i in self.rand]
        self.all_rand = len(self.rand) == len(params)
        self.rand_idx = None if self.all_rand or not self.rand else to_device(self.rand, device)
        self.knobs = FilterTensors.build(rp, vocab_size, device) if rp else None
        self.seeded = [j for j, p in enumerate(rp) if p.seed is not None]
        unseeded = [j for j, p in enumerate(rp) if p.seed is None]
        self.unseeded_idx = to_device(unseeded, device) if self.seeded and unseeded else None
        self.lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.lp_idx = to_device(self.lp_rows, device) if self.want_lp else None
        self.lp_n = min(max((params[i].logprobs for i in self.lp_rows), default=0), vocab_size)

    def below_min_tokens(self, seqs: list) -> bool:
        return any(seqs[i].num_output_tokens < seqs[i].params.min_tokens for i in self.min_rows)


@dataclass
class SampledTokens:
    """One step's sample still on the device: the ids, and the logprob tensors when rows asked."""

    token_ids: torch.Tensor
    """[B] long, one per row."""
    logprob_parts: tuple | None = None
    """(rows, ns, chosen [Bl], top_lp [Bl, N], top_id [Bl, N]) for the Bl rows that asked (N may be 0)."""

    def tensors(self) -> list[torch.Tensor]:
        """What has to reach the host: ids first."""
        if self.logprob_parts is None:
            return [self.token_ids]
        return [self.token_ids, *self.logprob_parts[2:]]

    def output(self, host: list[torch.Tensor] | None = None) -> SamplerOutput:
        """Host lists, from host copies of `tensors()` (from the device tensors themselves when None)."""
        host = host or self.tensors()
        token_ids = host[0].tolist()
        if self.logprob_parts is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        rows, ns = self.logprob_parts[:2]
        chosen, top_lp, top_id = (t.tolist() for t in host[1:])
        out: list[dict[int, float] | None] = [None] * len(token_ids)
        for j, (i, n) in enumerate(zip(rows, ns)):
            d = {token_ids[i]: chosen[j]}
            for k in range(n):
                d.setdefault(top_id[j][k], top_lp[j][k])
            out[i] = d
        return SamplerOutput(token_ids=token_ids, logprobs=out)


class Sampler:
    """Batched sampler; see the module docstring for the semantics.

    eos_token_ids: masked for rows below their min_tokens (stop_token_ids are masked too).
    seed: seeds the generator shared by unseeded random rows.
    """

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}

    def _shared_gen(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def _seeded_gen(self, device: torch.device) -> torch.Generator:
        if device not in self._seeded:
            self._seeded[device] = torch.Generator(device=device)
        return self._seeded[device]

    def _exponential(self, shape: tuple[int, int], seqs: list[SamplingRow], device: torch.device,
                     plan: _BatchPlan | None = None) -> torch.Tensor:
        """q ~ Exp(1): [R, V]; seeded rows from their own (seed, step) stream, the rest from the shared one."""
        q = torch.empty(shape, dtype=torch.float32, device=device)
        seeded = plan.seeded if plan is not None else [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if not seeded:
            q.exponential_(generator=self._shared_gen(device))
        else:
            unseeded = plan.unseeded_idx if plan is not None else None
            if plan is None and len(seeded) < len(seqs):
                unseeded = to_device([i for i, s in enumerate(seqs) if s.params.seed is None], device)
            if unseeded is not None:
                draw = torch.empty(unseeded.numel(), shape[1], dtype=torch.float32, device=device)
                q[unseeded] = draw.exponential_(generator=self._shared_gen(device))
            g = self._seeded_gen(device)
            for i in seeded:
                s = seqs[i]
                g.manual_seed(seed_for_step(s.params.seed, s.num_output_tokens))
                q[i].exponential_(generator=g)
        # Exp(1) can round to 0; keep masked tokens (prob 0) at 0 instead of nan / inf.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)

    def process(self, logits: torch.Tensor, seqs: list[SamplingRow],
                allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 copy of the logits with min_tokens masking, logit bias, the allowed mask and penalties applied
        (the input is not touched)."""
        # logits: [B, V] -> [B, V] fp32
        x = logits.to(torch.float32, copy=True)
        apply_min_tokens(x, seqs, self.eos_token_ids)
        apply_logit_bias(x, seqs)
        if allowed is not None:
            apply_allowed_mask(x, *allowed)
        if any(uses_penalties(s.params) for s in seqs):
            apply_penalties(x, seqs)
        return x

    _plan: _BatchPlan | None = None

    def _plan_for(self, seqs: list, vocab_size: int, device: torch.device) -> _BatchPlan:
        key = (device, vocab_size, *(id(s.params) for s in seqs))
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plan = _BatchPlan(seqs, vocab_size, device)
            plan.key = key
        return plan

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow],
                 allowed: tuple[torch.Tensor, torch.Tensor] | None = None, defer: bool = False):
        """`allowed`: (rows [M] long, bitmask [M, ceil(V/32)] int32) for the rows a grammar constrains.
        Returns a `SamplerOutput` (host lists), or with `defer` the `SampledTokens` still on the device."""
        sampled = self.sample(logits, seqs, allowed)
        return sampled if defer else sampled.output()

    def sample(self, logits: torch.Tensor, seqs: list[SamplingRow],
               allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampledTokens:
        """The step's tokens (and logprobs) as device tensors; nothing here waits for the device."""
        # logits: [B, V], row i belongs to seqs[i]
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        dev = logits.device
        plan = self._plan_for(seqs, logits.shape[1], dev)
        if allowed is None and plan.plain_greedy and not plan.below_min_tokens(seqs):
            return SampledTokens(logits.argmax(dim=-1))

        x = self.process(logits, seqs, allowed)  # [B, V]
        tokens = x.argmax(dim=-1)  # [B]; random rows are overwritten below
        if plan.rand:
            xr, rseqs = (x, seqs) if plan.all_rand else (x[plan.rand_idx], [seqs[i] for i in plan.rand])  # [R, V]
            probs = filter_logits(xr, [s.params for s in rseqs], plan.knobs).softmax(dim=-1)  # [R, V]
            q = self._exponential(tuple(probs.shape), rseqs, dev, plan)  # [R, V]
            sampled = probs.div_(q).argmax(dim=-1)  # [R]
            if plan.all_rand:
                tokens = sampled
            else:
                tokens[plan.rand_idx] = sampled
        return SampledTokens(tokens, self._logprobs(x, tokens, plan) if plan.want_lp else None)

    @staticmethod
    def _logprobs(x: torch.Tensor, tokens: torch.Tensor, plan: _BatchPlan) -> tuple:
        """{sampled: logprob, top-n...} per row that asked, from log_softmax of the processed logits, as
        device tensors (`SampledTokens.output` makes the dicts)."""
        # x: [B, V] processed logits; tokens: [B]
        lp = torch.log_softmax(x[plan.lp_idx], dim=-1)  # [Bl, V]
        lp = torch.nan_to_num_(lp, nan=MIN_LOGPROB, neginf=MIN_LOGPROB).clamp_(MIN_LOGPROB, 0.0)
        chosen = lp.gather(1, tokens[plan.lp_idx][:, None]).squeeze(1)  # [Bl]
        n = plan.lp_n
        top_lp, top_id = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], lp[:, :0].long())  # [Bl, N]
        ns = [min(plan.params[i].logprobs, n) for i in plan.lp_rows]
        return plan.lp_rows, ns, chosen, top_lp, top_id
