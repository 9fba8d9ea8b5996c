"""The Llama family: Llama-2/3 (llama3 rope scaling), SmolLM2, Mistral, Qwen2/2.5 (qkv bias),
Qwen3 (per-head q/k RMSNorm). Tied or untied embeddings.

The decoder layer takes its MLP from a factory so the MoE families (mixtral.py, qwen_moe.py) reuse the
attention block unchanged. Notation: T tokens in the step, H hidden, Hq/Hk heads, D head dim.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.layers import fused_ops
from ferrylm.layers.activation import get_act
from ferrylm.layers.attention import PagedAttention
from ferrylm.layers.embedding import ParallelLMHead, ParallelVocabEmbedding, TiedLMHead
from ferrylm.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ferrylm.layers.norm import RMSNorm
from ferrylm.layers.rotary import RotaryEmbedding
from ferrylm.models.base import CausalLM


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        # heads of this tensor-parallel rank (all of them in one process)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.head_dim, bias=cfg.attention_bias)
        self.hq, self.hk, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        rot = int(self.d * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(self.d, rot, cfg.context_limit, cfg.rope_theta, cfg.rope_scaling,
                                      freq_factors=cfg.rope_freqs, native_positions=cfg.max_position_embeddings)
        self.attn = PagedAttention(layer_idx, self.hq, self.hk, self.d, scale=self.d ** -0.5,
                                   sliding_window=cfg.window_of(layer_idx))

    def qkv(self, positions: torch.Tensor, x: torch.Tensor):
        # x: [T, H] -> q: [T, Hq, D]; k, v: [T, Hk, D] (rotated, ready for the cache)
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q = q.view(-1, self.hq, self.d)
        k = k.view(-1, self.hk, self.d)
        v = v.view(-1, self.hk, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, bias=bias,
                                                 shards={"gate": (0, inter), "up": (inter, inter)})
        self.inter = self.gate_up_proj.shards["gate"][1]  # this tensor-parallel rank's share
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = get_act(act)
        self.silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [T, 2I]: gate, up
        if self.silu and gu.dim() == 2 and fused_ops.usable(gu):
            return self.down_proj(fused_ops.silu_mul(gu))  # one launch, as torch rounds
        gate, up = gu.split(self.inter, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


MLPFactory = Callable[[ModelConfig, int], nn.Module]


def dense_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    mlp_name = "mlp"

    def __init__(self, cfg: ModelConfig, layer_idx: int, make_mlp: MLPFactory, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, make_mlp(cfg, layer_idx))  # keeps the checkpoint's module name

    # A layer is pre -> attention -> post. Only attention reads the per-step context, so the piecewise
    # CUDA graphs (engine/cuda_graph.py) capture pre and post and run attention between them.
    def pre(self, positions: torch.Tensor, x: torch.Tensor):
        return self.self_attn.qkv(positions, self.input_layernorm(x))

    def post(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # x: residual stream [T, H]; attn_out: [T, Hq * D]
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn.o_proj(attn_out))  # x + o, its norm
        return x + getattr(self, self.mlp_name)(h)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.post(x, self.self_attn.attn(*self.pre(positions, x)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, make_mlp: MLPFactory, mlp_name: str):
        super().__init__()
        self.embed_tokens = ParallelVocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, make_mlp, mlp_name) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    make_mlp: MLPFactory = staticmethod(dense_mlp)
    cuda_graphs = True
    piecewise = True
    tensor_parallel = True
    """Built from sharded layers (`layers/parallel_linear.py`): runs with tensor_parallel_size > 1."""
    mlp_name = "mlp"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.make_mlp, self.mlp_name)
        # length-dependent RoPE reads the step's sequence lengths, which piecewise graphs do not capture
        self.cuda_graphs = type(self).cuda_graphs and not self.model.layers[0].self_attn.rotary.length_dependent
        self.tied = cfg.tie_word_embeddings
        if self.tied:  # the embedding table's own matmul (packed or dense)
            self.lm_head = TiedLMHead(self.model.embed_tokens)
        else:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)

    @property
    def attn_width(self) -> int:
        a = self.model.layers[0].self_attn
        return a.hq * a.d

    def layer_pre(self, i: int, positions: torch.Tensor, x: torch.Tensor):
        return self.model.layers[i].pre(positions, x)  # q, k, v

    def layer_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i].self_attn.attn(q, k, v)  # [T, Hq * D]

    def layer_post(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i].post(x, attn_out)

    def map_weight(self, name: str, tensor: torch.Tensor) -> bool:
        # A tied checkpoint may still carry lm_head.weight (equal to the embeddings): nothing to do.
        return self.tied and name == "lm_head.weight"
