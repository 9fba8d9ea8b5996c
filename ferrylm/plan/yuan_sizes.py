"""Planner-facing sizes of the Yuan2.0 family: parameter counts (total, and active per token for M32), the
per-sequence LF filter state and the KV bytes per token, all from HF `config.json` dicts.

Pure arithmetic on config keys (`YuanConfig` names): no torch, no model. The real configs are below; their
counts match the published totals (2B 2.09B, 51B 51.8B, 102B 102.6B, M32 39.9B total / 3.7B active).
The 51B and 102B sizes come from the vendor's Megatron launch scripts (`examples/pretrain_yuan2.0_51B.sh`,
`_102B.sh`: hidden 8192, 64 heads, 42 / 84 layers, no `--ffn-hidden-size`, so Megatron's default 4 * hidden
= 32768, as 2B's 8192 = 4 * 2048); the vocabulary (135040) and tied embeddings are shared by the family.
"""

from __future__ import annotations

from dataclasses import dataclass

_COMMON = dict(architectures=["YuanForCausalLM"], model_type="yuan", vocab_size=135040, hidden_act="silu",
               rms_norm_eps=1e-6, tie_word_embeddings=True, eod_token_id=77185)

YUAN2_2B = dict(_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                max_position_embeddings=8192)
YUAN2_51B = dict(_COMMON, hidden_size=8192, intermediate_size=32768, num_hidden_layers=42, num_attention_heads=64,
                 max_position_embeddings=4096)
YUAN2_102B = dict(YUAN2_51B, num_hidden_layers=84)
YUAN2_M32 = dict(_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
                 attention_projection_size=4096, max_position_embeddings=4096, use_moe=True,
                 moe_config=dict(moe_num_experts=32, moe_top_k=2, ffn_hidden_size=8192, gated_linear_unit=True,
                                 norm_topk_prob=True))

REAL_CONFIGS = {"Yuan2-2B": YUAN2_2B, "Yuan2-51B": YUAN2_51B, "Yuan2-102B": YUAN2_102B, "Yuan2-M32": YUAN2_M32}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Every parameter (tied embeddings counted once)."""
    active: int
    """Parameters one token touches: all but the experts it is not routed to (= total when dense)."""
    embedding: int
    """Of `total`, the embedding (plus lm_head when untied)."""


def _moe(cfg: dict) -> dict | None:
    moe = cfg.get("moe_config") or {}
    return moe if cfg.get("use_moe") and int(moe.get("moe_num_experts") or 0) > 0 else None


def head_dim(cfg: dict) -> int:
    return int(cfg.get("attention_projection_size") or cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def param_counts(cfg: dict) -> ParamCounts:
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    P = head_dim(cfg) * int(cfg["num_attention_heads"])  # attention width
    tied = bool(cfg.get("tie_word_embeddings", True))
    attn = 3 * H * P + P * H  # q, k, v, o (no bias)
    lf = (2 * H * (H // 2) + H // 2) + (2 * (H // 2) * H + H) + H  # conv1, conv2 (2 taps, bias), LF norm
    norms = 2 * H  # input, post-attention
    moe = _moe(cfg)
    if moe is None:
        mlp = mlp_active = 3 * H * int(cfg["intermediate_size"])
    else:
        E, k, F = int(moe["moe_num_experts"]), int(moe["moe_top_k"]), int(moe["ffn_hidden_size"])
        expert = 2 * F * H + F * H  # w1 [2F, H], w2 [H, F]
        router = 3 * H * E  # query, key, value
        mlp, mlp_active = router + E * expert, router + k * expert
    embed = V * H * (1 if tied else 2)
    shared = L * (attn + lf + norms) + embed + H  # + final norm
    return ParamCounts(total=shared + L * mlp, active=shared + L * mlp_active, embedding=embed)


def lf_state_values(cfg: dict) -> int:
    """Filter state per sequence: per layer the last filter input (H) and the last conv1 output (H/2)."""
    H = int(cfg["hidden_size"])
    return int(cfg["num_hidden_layers"]) * (H + H // 2)


def lf_state_bytes(cfg: dict, dtype_bytes: int = 2) -> int:
    """Bytes of filter state one running sequence holds, whatever its length (1.5 * H values per layer)."""
    return lf_state_values(cfg) * dtype_bytes


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers (MHA: kv heads = heads)."""
    return 2 * int(cfg["num_hidden_layers"]) * int(cfg["num_attention_heads"]) * head_dim(cfg) * dtype_bytes
