"""Rotary position embedding (HF's rotate-half layout) and every common frequency scaling: linear,
llama3, yarn (with its attention factor), dynamic NTK, longrope/su, and llama.cpp's per-frequency
factors (a GGUF's `rope_freqs` tensor).

Static scalings use one fp32 cos/sin table per device, indexed by absolute positions, so a token's
rotation never depends on what else is in the batch. Two scalings depend on the sequence length, as
transformers defines them: dynamic NTK (the base grows with the length past `max_position_embeddings`)
and longrope (long factors once the length passes the original context). transformers takes that
length from the whole forward call; here it is each token's own sequence length after the step
(`ForwardContext.step_lens`), so batching never changes a result. A token keeps the rotation it was
cached with, exactly as transformers' KV cache does. This module knows nothing about attention.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ferrylm.errors import ConfigError
from ferrylm.layers import fused_ops

SUPPORTED = ("linear", "llama3", "yarn", "dynamic", "longrope", "su")


def _need(scaling: dict, key: str):
    if scaling.get(key) is None:
        raise ConfigError(f"rope_scaling of type {scaling.get('rope_type', scaling.get('type'))!r} lacks {key!r}")
    return scaling[key]


def _yarn(inv_freq: torch.Tensor, rot_dim: int, base: float, s: dict, max_positions: int):
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between (transformers' recipe)."""
    orig = _need(s, "original_max_position_embeddings")
    factor = s.get("factor") or max_positions / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rotations):  # the dimension that turns `rotations` times over the original context
        return rot_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, unchanged); 0: interpolate by factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attn)


def rope_parameters(rot_dim: int, base: float, scaling: dict | None, max_positions: int,
                    freq_factors: tuple[float, ...] = ()) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """(inv_freq [rot/2], attention factor, long inv_freq for longrope or None) for a static table."""
    # inv_freq: [rot_dim / 2]
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if freq_factors:  # llama.cpp divides each frequency's angle by its factor (Llama-3.1 GGUFs)
        if len(freq_factors) != rot_dim // 2:
            raise ConfigError(f"rope_freqs has {len(freq_factors)} factors for {rot_dim // 2} frequencies")
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0, None
    if kind == "linear":
        return inv_freq / _need(scaling, "factor"), 1.0, None
    if kind == "llama3":
        factor = _need(scaling, "factor")
        low, high = _need(scaling, "low_freq_factor"), _need(scaling, "high_freq_factor")
        old_len = _need(scaling, "original_max_position_embeddings")
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0, None
    if kind == "yarn":
        return (*_yarn(inv_freq, rot_dim, base, scaling, max_positions), None)
    if kind == "dynamic":
        _need(scaling, "factor")
        return inv_freq, 1.0, None  # per-length frequencies are computed in forward
    if kind in ("longrope", "su"):
        orig = _need(scaling, "original_max_position_embeddings")
        short, long = _need(scaling, "short_factor"), _need(scaling, "long_factor")
        if len(short) != rot_dim // 2 or len(long) != rot_dim // 2:
            raise ConfigError(f"rope_scaling short_factor/long_factor need {rot_dim // 2} entries")
        factor = scaling.get("factor") or max_positions / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        shape = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        return (1.0 / (torch.tensor(short, dtype=torch.float32) * base ** shape), float(attn),
                1.0 / (torch.tensor(long, dtype=torch.float32) * base ** shape))
    raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED)}")


def context_limit(scaling: dict | None, max_positions: int) -> int:
    """Positions a scaled model serves: dynamic NTK and linear stretch `max_position_embeddings` by
    their factor, yarn serves `original_max_position_embeddings * factor` (vLLM's rule); the others
    already say their extended length in `max_position_embeddings`."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    factor = float((scaling or {}).get("factor") or 1.0)
    if kind in ("dynamic", "linear"):
        return max(max_positions, int(max_positions * factor))
    if kind == "yarn":
        return max(max_positions, int((scaling.get("original_max_position_embeddings") or max_positions) * factor))
    return max_positions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_TABLES: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()
"""The cos/sin tables by (rotation, length, device): shared by every layer (and engine) that asks for the same
one, held by the modules that use it (`RotaryEmbedding._held`), so a dropped engine's tables go with it."""


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rot_dim` features of each head of q and k.

    `native_positions` is the config's `max_position_embeddings`: the length past which dynamic NTK
    starts stretching the base; `max_positions` (how long the tables are) may be larger."""

    def __init__(self, head_dim: int, rot_dim: int, max_positions: int, base: float,
                 scaling: dict | None = None, table_dtype: torch.dtype = torch.float32,
                 freq_factors: tuple[float, ...] = (), native_positions: int | None = None):
        super().__init__()
        self.head_dim, self.rot_dim, self.base = head_dim, rot_dim, base
        self.native_positions = native_positions or max_positions
        self.max_positions = max_positions
        self.table_dtype = table_dtype
        with torch.device("cpu"):  # tiny, and real even when the model is built on meta
            inv_freq, self.attention_factor, long_inv = rope_parameters(rot_dim, base, scaling, self.native_positions,
                                                                         tuple(freq_factors))
        self.kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        self.factor = float((scaling or {}).get("factor") or 1.0)
        self.long_after = int((scaling or {}).get("original_max_position_embeddings") or 0)
        """longrope: a sequence longer than this uses the long factors."""
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv, persistent=False)
        self._key = (type(self).__name__, rot_dim, table_dtype, self.attention_factor, tuple(self.inv_freq.tolist()))
        self._held: dict[tuple, torch.Tensor] = {}
        """The tables this module uses (`_TABLES` only shares them)."""

    @property
    def length_dependent(self) -> bool:
        """Rotation depends on the sequence length (reads `ForwardContext.step_lens`): no CUDA graphs."""
        return self.kind in ("dynamic", "longrope", "su")

    def _table(self, device: torch.device, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        """cos/sin for every position the model allows, [P, 2, rot] fp32, one copy per device shared by
        all layers. Built in full so no step has to read its max position (a GPU sync per layer); the
        model runner builds it before sizing the KV cache."""
        inv = self.inv_freq if inv_freq is None else inv_freq
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" are one table (steps pass q.device)
            dev = torch.device("cuda", torch.cuda.current_device())
        key = (*self._key, tuple(inv.tolist()), self.max_positions, str(dev))
        table = self._held.get(key)
        if table is None:
            table = _TABLES.get(key)
            if table is None:  # (Yuan's _build override takes only the device)
                table = _TABLES[key] = self._build(dev) if inv_freq is None else self._build(dev, inv)
            self._held[key] = table
        return table

    def _build(self, device: torch.device, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        inv = (self.inv_freq if inv_freq is None else inv_freq).to(device).float()
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)  # [P, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
        # table_dtype rounds the finished fp32 tables (a family whose reference computes the angles
        # themselves in low precision, like Yuan-M32, overrides _build).
        cs = torch.stack((emb.cos(), emb.sin())) * self.attention_factor
        return cs.to(self.table_dtype).float().transpose(0, 1).contiguous()

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[T, 2, rot] fp32 for each token."""
        if not self.length_dependent:
            return self._table(device)[positions]
        from ferrylm.layers.context import get_forward_context

        lens = get_forward_context().step_lens(positions)  # [T]
        if self.kind != "dynamic":  # longrope: short or long table per token's sequence length
            long = (lens > self.long_after)[:, None, None]
            return torch.where(long, self._table(device, self.long_inv_freq)[positions], self._table(device)[positions])
        # dynamic NTK: base * (factor * L / P - (factor - 1)) ** (rot / (rot - 2)) for L past P
        P, f, r = self.native_positions, self.factor, self.rot_dim
        L = lens.clamp(min=P).float()
        base = self.base * (f * L / P - (f - 1)) ** (r / (r - 2))  # [T]
        expo = torch.arange(0, r, 2, dtype=torch.int64, device=device).float() / r  # [rot/2]
        inv = 1.0 / base[:, None] ** expo[None, :]  # [T, rot/2]
        freqs = positions.float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rot]
        return torch.stack((emb.cos(), emb.sin()), dim=1)  # [T, 2, rot]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]
        if not self.length_dependent and fused_ops.rope_usable(q, k, self.rot_dim):  # one launch, torch's bits
            return fused_ops.rope(positions, q, k, self._table(q.device), self.rot_dim)
        cs = self.cos_sin(positions, q.device)
        cos, sin = cs[:, 0, None, :].to(q.dtype), cs[:, 1, None, :].to(q.dtype)  # [T, 1, rot]
        r = self.rot_dim
        if r == self.head_dim:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        return q, k
