"""Sampler: one step's logits in, one token per sequence out (plus logprobs when a row asks).

Owns vLLM's per-token sampling semantics, batched and vectorised, on whatever device the logits live:
min_tokens masking of stop ids, repetition / presence / frequency penalties, temperature, min-p, top-k,
top-p, greedy and random sampling, per-request seeds, `logit_bias`, and an optional allowed-token bitmask
(structured outputs: the grammar engine fills it, the sampler only applies it). Each row comes as a plain
`SamplingRow` (params, token ids, prompt length): it knows nothing about sequences, tokenizers, grammars,
stop strings, scheduling or when a sequence finishes.

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


def _uses_penalties(p: SamplingParams) -> bool:
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
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """In place: repetition penalty over prompt + output tokens, presence / frequency over output tokens."""
    # logits: [B, V] fp32
    B, V = logits.shape
    dev = logits.device
    params = [s.params for s in seqs]
    use = [_uses_penalties(p) for p in params]

    if any(p.repetition_penalty != 1.0 for p in params):
        ids = _pad_ids([s.token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)], V, dev)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]  # [B, V]
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]  # [B, 1]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        out = [s.output_token_ids if u else [] for s, u in zip(seqs, use)]
        ids = _pad_ids(out, V, dev)  # [B, L]
        counts = torch.zeros(B, V + 1, dtype=torch.float32, device=dev)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :V]  # [B, V]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]  # [B, 1]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]  # [B, 1]
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
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
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


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p for rows sampled at random; returns a new tensor.

    softmax of the result is the distribution each row samples from.
    """
    # logits: [R, V] fp32 processed logits
    R, V = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32, device=dev)
    x = logits / temp[:, None]  # [R, V]

    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)[:, None]  # [R, 1]
        probs = x.softmax(dim=-1)
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))

    use_k = any(0 < p.top_k < V for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev) if use_k else None
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev) if use_p else None
        x = apply_top_k_top_p(x, top_k, top_p)
    return x


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

    def _exponential(self, shape: tuple[int, int], seqs: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """q ~ Exp(1): [R, V]; seeded rows from their own (seed, step) stream, the rest from the shared one."""
        q = torch.empty(shape, dtype=torch.float32, device=device)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if not seeded:
            q.exponential_(generator=self._shared_gen(device))
        else:
            unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
            if unseeded:
                draw = torch.empty(len(unseeded), shape[1], dtype=torch.float32, device=device)
                q[torch.tensor(unseeded, device=device)] = draw.exponential_(generator=self._shared_gen(device))
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
        if any(_uses_penalties(s.params) for s in seqs):
            apply_penalties(x, seqs)
        return x

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow],
                 allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        """`allowed`: (rows [M] long, bitmask [M, ceil(V/32)] int32) for the rows a grammar constrains."""
        # logits: [B, V], row i belongs to seqs[i]
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        params = [s.params for s in seqs]
        want_lp = any(p.logprobs is not None for p in params)
        if (
            allowed is None
            and all(p.greedy and not p.logit_bias for p in params)
            and not want_lp
            and not any(_uses_penalties(p) for p in params)
            and not any(s.num_output_tokens < s.params.min_tokens for s in seqs)
        ):
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=None)

        dev = logits.device
        x = self.process(logits, seqs, allowed)  # [B, V]
        tokens = x.argmax(dim=-1)  # [B]; random rows are overwritten below

        rand = [i for i, p in enumerate(params) if not p.greedy]
        if rand:
            if len(rand) == len(seqs):
                xr, rseqs = x, seqs
            else:
                xr, rseqs = x[torch.tensor(rand, device=dev)], [seqs[i] for i in rand]  # [R, V]
            probs = filter_logits(xr, [s.params for s in rseqs]).softmax(dim=-1)  # [R, V]
            q = self._exponential(tuple(probs.shape), rseqs, dev)  # [R, V]
            sampled = probs.div_(q).argmax(dim=-1)  # [R]
            if len(rand) == len(seqs):
                tokens = sampled
            else:
                tokens[torch.tensor(rand, device=dev)] = sampled

        token_ids = tokens.tolist()
        logprobs = self._logprobs(x, token_ids, params) if want_lp else None
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _logprobs(
        self, x: torch.Tensor, token_ids: list[int], params: list[SamplingParams]
    ) -> list[dict[int, float] | None]:
        """{sampled: logprob, top-n...} per row that asked, from log_softmax of the processed logits."""
        # x: [B, V] processed logits
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(rows, device=x.device)
        lp = torch.log_softmax(x[idx], dim=-1)  # [Bl, V]
        lp = torch.nan_to_num_(lp, nan=MIN_LOGPROB, neginf=MIN_LOGPROB).clamp_(MIN_LOGPROB, 0.0)
        chosen = torch.tensor([token_ids[i] for i in rows], device=x.device)
        chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1).tolist()  # [Bl]
        n = min(max(params[i].logprobs for i in rows), x.shape[1])
        top_lp, top_id = lp.topk(n, dim=-1) if n > 0 else (None, None)  # [Bl, N]
        top_lp = top_lp.tolist() if n > 0 else None
        top_id = top_id.tolist() if n > 0 else None

        out: list[dict[int, float] | None] = [None] * len(params)
        for j, i in enumerate(rows):
            d = {token_ids[i]: chosen_lp[j]}
            for k in range(min(params[i].logprobs, n)):
                d.setdefault(top_id[j][k], top_lp[j][k])
            out[i] = d
        return out
