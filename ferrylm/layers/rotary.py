"""Rotary position embedding (HF's rotate-half layout), with linear and llama3 frequency scaling.

Tables are built in fp32 once per device and indexed by absolute positions, so a token's rotation never
depends on what else is in the batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ferrylm.errors import ConfigError


def rope_inv_freq(rot_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    # inv_freq: [rot_dim / 2]
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_TABLES: dict[tuple, torch.Tensor] = {}


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rot_dim` features of each head of q and k."""

    def __init__(self, head_dim: int, rot_dim: int, max_positions: int, base: float,
                 scaling: dict | None = None, table_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head_dim, self.rot_dim = head_dim, rot_dim
        self.max_positions = max_positions
        self.table_dtype = table_dtype
        with torch.device("cpu"):  # tiny, and real even when the model is built on meta
            inv_freq = rope_inv_freq(rot_dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._key = (type(self).__name__, rot_dim, table_dtype, tuple(self.inv_freq.tolist()))

    def _table(self, device: torch.device) -> torch.Tensor:
        """cos/sin for every position the model allows, [P, 2, rot] fp32, one copy per device shared by
        all layers. Built in full so no step has to read its max position (a GPU sync per layer); the
        model runner builds it before sizing the KV cache."""
        key = (*self._key, self.max_positions, str(device))
        if key not in _TABLES:
            _TABLES[key] = self._build(torch.device(device))
        return _TABLES[key]

    def _build(self, device: torch.device) -> torch.Tensor:
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device).float())  # [P, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
        # table_dtype rounds the finished fp32 tables (a family whose reference computes the angles
        # themselves in low precision, like Yuan-M32, overrides _build).
        return torch.stack((emb.cos(), emb.sin())).to(self.table_dtype).float().transpose(0, 1).contiguous()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]
        cs = self._table(q.device)[positions]
        cos, sin = cs[:, 0, None, :].to(q.dtype), cs[:, 1, None, :].to(q.dtype)  # [T, 1, rot]
        r = self.rot_dim
        if r == self.head_dim:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        return q, k
