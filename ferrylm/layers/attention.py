"""Paged attention in plain torch: new K/V go into the block pool, attention reads it back by block table.

Decodes (one new token each) run batched: their context is gathered from the blocks into a padded
[B, S] view and masked. Prefill chunks run one sequence at a time, causally offset by the tokens already
cached (prefix-cache hits and earlier chunks). Runs on CPU and CUDA through `scaled_dot_product_attention`.

A layer with a sliding window W lets the query at position p see keys p - W + 1 .. p (HF's
`kv_idx > q_idx - sliding_window`), in every path: the masks add the lower bound. The cache keeps the
blocks that left the window (masked, not freed): no memory saving yet; decode and offset prefill skip
reading the blocks wholly before the window (not the CUDA-graph decode, which has no host lengths).

A quantized cache (fp8 / int8 codes with per-row scales, `kv/cache.py`) is dequantized as it is gathered;
every read, the prefill chunk's own keys included, comes from the cache, as the kernels read it.

This torch path is the reference and the CPU path. On CUDA the Triton kernels (`layers/triton_attention.py`)
read the blocks in place: `backend` (set by the model runner from `EngineConfig.attention_backend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.errors import ConfigError
from ferrylm.kv.cache import gather
from ferrylm.layers import triton_attention
from ferrylm.layers.context import get_forward_context


def resolve_backend(name: str, device: torch.device, kv_dtype: torch.dtype | None = None) -> str:
    """`EngineConfig.attention_backend` -> "torch" | "triton" for this device and KV cache dtype."""
    ok = triton_attention.available(device, kv_dtype)
    if name == "triton" and not ok:
        raise ConfigError("attention_backend triton needs Triton and a CUDA device (sm_89+ for an fp8 KV cache), "
                          "or TRITON_INTERPRET=1; use auto or torch")
    return "triton" if ok and (name == "triton" or (name == "auto" and device.type == "cuda")) else "torch"


class PagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, latent_values: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = sliding_window
        """Keys a query sees, itself included; None: the whole causal context."""
        self.latent_values = latent_values
        """MLA: the values are the first `latent_values` features of each cached key (the compressed
        latent), so no V cache is read or written; None: values come from the V cache."""
        self.backend = "torch"
        """"torch" (this file) or "triton" (`layers/triton_attention.py`); see `resolve_backend`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hk, D] (v: [T, Hk, 0] with latent values) -> out: [T, H * Dv]
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_idx)  # [N, bs, Hk, D] each
        ctx.kv_cache.write(self.layer_idx, ctx.slot_mapping, k, v)
        k_scale, v_scale = ctx.kv_cache.scales(self.layer_idx)  # [N, bs, Hk] each, or None
        dv = self.latent_values or v_cache.shape[-1]
        out = q.new_empty(*q.shape[:2], dv)
        if self.backend == "triton":
            self._triton(q, k, v, out, k_cache, v_cache, k_scale, v_scale, ctx)
            return out.flatten(1)
        nd = ctx.num_decodes
        W, bs = self.window, k_cache.shape[1]
        for a, b, max_len in ctx.decode_groups or ([(0, nd, ctx.decode_max_len)] if nd else []):
            # blocks wholly before every row's window are not read (a padded decode has no host lengths)
            first = 0 if W is None or ctx.padded_decode else max(0, min(ctx.seq_lens[a:b]) - W) // bs
            out[a:b] = self._decode(q[a:b], k_cache, v_cache, ctx.block_tables[a:b], ctx.decode_seq_lens[a:b],
                                    max_len, ctx.padded_decode, first, k_scale, v_scale)
        self._torch_prefills(q, k, v, out, k_cache, v_cache, k_scale, v_scale, ctx)
        return out.flatten(1)

    def _plain(self, ctx, i: int) -> bool:
        # a fresh prompt inside its window: SDPA's own causal mask is exact
        return ctx.start_pos[i] == 0 and (self.window is None or ctx.seq_lens[i] <= self.window)

    def _torch_prefills(self, q, k, v, out, k_cache, v_cache, k_scale, v_scale, ctx) -> None:
        for i in range(ctx.num_decodes, ctx.num_seqs):
            a, b = ctx.query_start_loc[i], ctx.query_start_loc[i + 1]
            mask = None if self._plain(ctx, i) else ctx.prefill_mask(i, q.device, self.window)
            out[a:b] = self._prefill(q[a:b], k[a:b], v[a:b], k_cache, v_cache, ctx.block_tables[i], ctx.start_pos[i],
                                     ctx.seq_lens[i], mask, k_scale, v_scale)

    def _triton(self, q, k, v, out, k_cache, v_cache, k_scale, v_scale, ctx) -> None:
        # q: [T, H, D] -> out: [T, H, Dv], decode rows then every prefill chunk, each in one launch
        nd, kw = ctx.num_decodes, dict(window=self.window, k_scale=k_scale, v_scale=v_scale,
                                       latent_values=self.latent_values)
        if nd:
            triton_attention.paged_decode(q[:nd], k_cache, v_cache, ctx.block_tables[:nd], ctx.decode_seq_lens,
                                          self.scale, ctx.decode_max_len, out=out[:nd], **kw)
        if nd < ctx.num_seqs and k_scale is None and not self.latent_values and all(
                self._plain(ctx, i) for i in range(nd, ctx.num_seqs)):
            # only fresh prompts: SDPA's flash kernel on the chunk's own K/V beats the paged kernel
            # (0.58x on a 2k prompt, H200, benchmarks/bench_attention.py)
            self._torch_prefills(q, k, v, out, k_cache, v_cache, k_scale, v_scale, ctx)
        elif nd < ctx.num_seqs:
            block_q = triton_attention.prefill_block_q(self.num_heads, self.num_kv_heads, self.head_dim, q.dtype)
            key = ("triton_prefill", block_q)
            if key not in ctx._masks:  # once per step, shared by every layer
                ctx._masks[key] = triton_attention.prefill_meta(ctx.query_start_loc, ctx.start_pos, ctx.seq_lens,
                                                                nd, block_q, q.device)
            meta, tiles = ctx._masks[key]
            triton_attention.paged_prefill(q, k_cache, v_cache, ctx.block_tables, meta, tiles, ctx.num_seqs,
                                           block_q, self.scale, out=out, **kw)

    def _sdpa(self, q, k, v, mask=None, causal=False):
        # q: [B, H, Sq, D]; k, v: [B, Hk, Sk, D]
        gqa = self.num_heads != self.num_kv_heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.scale, enable_gqa=gqa)

    def _decode(self, q, k_cache, v_cache, block_tables, seq_lens, max_len: int, padded: bool, first: int = 0,
                k_scale=None, v_scale=None):
        # q: [B, H, D]; block_tables: [B, nb]; seq_lens: [B]; keys from block `first` on (sliding window)
        B = q.shape[0]
        bs = k_cache.shape[1]
        nb = (max_len + bs - 1) // bs
        S = max_len - first * bs
        idx = block_tables[:, first:nb].flatten()  # index_select: advanced indexing is ~1000x slower on CPU
        k = gather(k_cache, k_scale, idx, q.dtype).view(B, (nb - first) * bs, *k_cache.shape[2:])[:, :S]
        # k: [B, S, Hk, D]
        if self.latent_values:
            v = k[..., :self.latent_values]  # [B, S, Hk, Dv]
        else:
            v = gather(v_cache, v_scale, idx, q.dtype).view(B, (nb - first) * bs, *v_cache.shape[2:])[:, :S]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hk, S, D]
        mask = None
        W = self.window
        if B > 1 or padded or (W is not None and S > W):  # shorter contexts must not see the padding
            pos = torch.arange(first * bs, max_len, device=q.device)[None, :]  # [1, S] absolute positions
            mask = pos < seq_lens[:, None]  # [B, S]
            if W is not None:  # the new token sits at seq_len - 1 and sees W keys back to itself
                mask = mask & (pos >= seq_lens[:, None] - W)
            mask = mask[:, None, None, :]
        o = self._sdpa(q[:, :, None, :], k, v, mask=mask)  # [B, H, 1, D]
        return o[:, :, 0, :]  # [B, H, Dv]

    def _prefill(self, q, k, v, k_cache, v_cache, block_table, start, seq_len, mask, k_scale=None, v_scale=None):
        # q: [n, H, D]; k, v: [n, Hk, D] (this chunk's own keys, already written to the cache); mask: [n, S]
        if start > 0 or k_scale is not None:  # earlier chunks or prefix-cache hits live only in the cache;
            # a quantized cache is read back for the chunk's own keys too (what the decode steps will see)
            bs = k_cache.shape[1]
            nb = (seq_len + bs - 1) // bs
            # sliding window: blocks wholly before the first query's window are not read
            first = 0 if self.window is None else max(0, start - self.window + 1) // bs
            bt = block_table[first:nb]
            k = gather(k_cache, k_scale, bt, q.dtype).flatten(0, 1)[:seq_len - first * bs]  # [S, Hk, D]
            if not self.latent_values:
                v = gather(v_cache, v_scale, bt, q.dtype).flatten(0, 1)[:seq_len - first * bs]
            if mask is not None:
                mask = mask[:, first * bs:]
        if self.latent_values:
            v = k[..., :self.latent_values]  # [S, Hk, Dv]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if mask is None:
            o = self._sdpa(qh, kh, vh, causal=True)
        else:
            o = self._sdpa(qh, kh, vh, mask=mask)  # causal, offset by the cached tokens (and windowed)
        return o[0].transpose(0, 1)  # [n, H, Dv]
