"""Families loaded from GGUF as from HF: qwen2, qwen3, llama with experts (Mixtral), qwen2moe, qwen3moe, olmoe
and deepseek2 (V2 and V3).

Each test builds a tiny random transformers model, writes it as a GGUF the way llama.cpp's
convert_hf_to_gguf.py would (tensor names from the gguf package's own `TensorNameMap`, experts stacked
[E, R, C], the converter's metadata keys, q/k permuted for llama only, DeepSeek's kv_b_proj split into
attn_k_b / attn_v_b), loads the file with ferrylm and compares greedy tokens and logits with
transformers (max difference printed).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from ferrylm.errors import ModelLoadError
from ferrylm.weights.gguf import GGUFSource
from test_models import DEEPSEEK, MLA, OLMOE, build, compare, prompts_of
from test_models_hf import FAMILIES

Q = gguf.GGMLQuantizationType
_ARCH = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "mixtral": gguf.MODEL_ARCH.LLAMA,
         "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
         "olmoe": gguf.MODEL_ARCH.OLMOE, "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
         "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2}


def _metadata(w: gguf.GGUFWriter, c, split_kv_b: bool) -> None:
    """The keys convert_hf_to_gguf.py writes for these models (TextModel + the family's set_gguf_parameters)."""
    mt = c.model_type
    rope = getattr(c, "rope_parameters", None) or {}
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    w.add_vocab_size(c.vocab_size)
    if getattr(c, "num_experts_per_tok", None):
        w.add_expert_used_count(c.num_experts_per_tok)
    if mt.startswith("deepseek"):
        w.add_expert_count(c.n_routed_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        if c.q_lora_rank is not None:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        if split_kv_b:  # newer converters: MLA as MQA over the latent, per-head sizes in the *_mla keys
            w.add_head_count_kv(1)
            w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
            w.add_value_length(c.kv_lora_rank)
            w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length_mla(c.v_head_dim)
        else:
            w.add_head_count_kv(c.num_key_value_heads)
            w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
            w.add_value_length(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        v3 = mt == "deepseek_v3"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        if v3 or getattr(c, "topk_method", "") == "group_limited_greedy":
            w.add_expert_group_count(c.n_group)
            w.add_expert_group_used_count(c.topk_group)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        return
    w.add_head_count_kv(c.num_key_value_heads)
    if mt in ("qwen2", "qwen3"):
        w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        return
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    if mt == "mixtral":
        return
    if mt != "olmoe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_key_length(c.head_dim if mt == "qwen3_moe" else c.hidden_size // c.num_attention_heads)
    if mt == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if getattr(c, "clip_qkv", None):
        w.add_clamp_kqv(c.clip_qkv)


def write_gguf(path, model, quant: dict | None = None, split_kv_b: bool = False) -> None:
    """`model` as llama.cpp's converter writes it. Tensors whose GGUF name ends with a key of `quant` are
    stored in that type, and the model's own weights are replaced by their dequantized values, so the
    reference runs the very numbers the file holds."""
    c, mt = model.config, model.config.model_type
    names = gguf.get_tensor_name_map(_ARCH[c.model_type], c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[_ARCH[c.model_type]])
    _metadata(w, c, split_kv_b)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith("experts.gate_up_proj"):  # transformers v5 fuses gate|up: [E, 2I, H]
            gate, up = t.chunk(2, dim=1)
            base = name[: -len("gate_up_proj")]
            out[names.get_name(base + "gate_proj.weight", (".weight",))] = gate
            out[names.get_name(base + "up_proj.weight", (".weight",))] = up
            continue
        if name.endswith("experts.down_proj"):
            out[names.get_name(name + ".weight", (".weight",))] = t
            continue
        if name.endswith("e_score_correction_bias"):  # the converter's own rename
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("shared_expert_gate.weight"):
            t = t.squeeze(0)  # llama.cpp's ffn_gate_inp_shexp is [H]
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            h, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
            k_b, v_b = t.view(h, nope + v, -1).split([nope, v], dim=1)
            out[names.get_name(name.replace("kv_b", "k_b"), (".weight",))] = k_b.transpose(1, 2)  # [h, R, n]
            out[names.get_name(name.replace("kv_b", "v_b"), (".weight",))] = v_b  # [h, v, R]
            continue
        gname = names.get_name(name, (".weight", ".bias"))
        assert gname is not None, name
        if mt == "mixtral" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            t = _permute(t, c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads)
        out[gname] = t
    for gname, t in out.items():
        qt = next((q for suffix, q in (quant or {}).items() if gname.endswith(suffix)), None)
        arr = np.ascontiguousarray(t.numpy())
        if qt is None:
            w.add_tensor(gname, arr)
        else:
            blocks = quantize(arr, qt)
            w.add_tensor(gname, blocks, raw_dtype=qt)
            _set_dequantized(model, gname, torch.from_numpy(dequantize(blocks, qt).copy()).reshape(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> ggml's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _set_dequantized(model, gname: str, values: torch.Tensor) -> None:
    """Put a quantized expert tensor's dequantized values back into the fused HF parameter."""
    layer, leaf = gname.split(".")[1], gname.split(".")[2]
    experts = model.model.layers[int(layer)].mlp.experts
    with torch.no_grad():
        if leaf == "ffn_down_exps":
            experts.down_proj.copy_(values)
        else:
            inter = values.shape[1]
            half = slice(0, inter) if leaf == "ffn_gate_exps" else slice(inter, 2 * inter)
            experts.gate_up_proj[:, half].copy_(values)


V3_GGUF = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # yarn with equal mscales, as GGUF stores it
    MLA, n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=128, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                      original_max_position_embeddings=32, mscale=0.707,
                                                      mscale_all_dim=0.707, beta_fast=32, beta_slow=1)))
CASES = {  # name -> (build spec, write_gguf options)
    "qwen2": (FAMILIES["qwen2"], {}),
    "qwen3-tied": (FAMILIES["qwen3"], {}),
    "llama-mixtral": (FAMILIES["mixtral"], {}),  # llama arch with experts, q/k permuted by the converter
    # llama.cpp's qwen2moe has no dense layers (mlp_only_layers); the shared expert and its gate it has
    "qwen2moe": ((*FAMILIES["qwen2_moe"][:2], {**FAMILIES["qwen2_moe"][2], "mlp_only_layers": []}), {}),
    "qwen3moe-q8_0": (FAMILIES["qwen3_moe"], {"quant": {"_exps.weight": Q.Q8_0}}),
    "olmoe": (("OlmoeConfig", "OlmoeForCausalLM", {**OLMOE["olmoe"], "attention_bias": False}), {}),
    "deepseek2-v2-lite": (DEEPSEEK["deepseek_v2-lite"], {}),
    "deepseek2-v2-grouped": (DEEPSEEK["deepseek_v2-grouped"], {"split_kv_b": True}),
    "deepseek2-v3": (V3_GGUF, {"split_kv_b": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_moe_matches_transformers(case, tmp_path_factory):
    spec, opts = CASES[case]
    _, ref = build(tmp_path_factory, case, *spec)
    path = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
    write_gguf(path, ref, **opts)
    with GGUFSource(str(path)) as src:
        assert src.config["architectures"] == [type(ref).__name__]
        assert not [n for n in src.unmapped if n.startswith("blk.")], src.unmapped
        if opts.get("split_kv_b"):
            assert "blk.0.attn_kv_b.weight" not in {t.name for t in src.tensors}
            assert src.gguf_name("model.layers.0.self_attn.kv_b_proj.weight") == "blk.0.attn_k_b.weight"
        c = src.config
        if case == "olmoe":
            assert c["clip_qkv"] == pytest.approx(0.3) and c["norm_topk_prob"] is False
        if case == "deepseek2-v3":
            assert c["rope_scaling"]["rope_type"] == "yarn" and c["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.707)
            assert (c["n_group"], c["topk_group"], c["topk_method"]) == (4, 2, "noaux_tc")
            assert "model.layers.1.mlp.gate.e_score_correction_bias" in src.keys()
        if "quant" in opts:
            assert src.ggml_type("model.layers.0.mlp.experts.1.up_proj.weight") == "Q8_0"
    # 40 tokens cross the yarn case's original context (32)
    compare(f"gguf {case}", str(path), ref, prompts_of(11, 40 if "v3" in case else 19))


@pytest.mark.parametrize("drop, gating, message", [
    ("deepseek2.attention.kv_lora_rank", 2, "lacks deepseek2.attention.kv_lora_rank"),
    (None, 3, "unsupported deepseek2.expert_gating_func 3"),
])
def test_deepseek2_metadata_errors_name_the_key(tmp_path, drop, gating, message):
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, v in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 4),
                   ("attention.kv_lora_rank", 32), ("rope.dimension_count", 8), ("attention.key_length", 24),
                   ("attention.value_length", 12), ("expert_gating_func", gating)):
        if f"deepseek2.{key}" != drop:
            w.add_uint32(f"deepseek2.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=message) as e:
        GGUFSource(str(path))
    assert str(path) in str(e.value)
