"""Model features against transformers: sliding-window attention, RoPE scalings, optional biases and the
newer families (OLMoE, DeepSeek-V2/V3). Tiny random-weight checkpoints written by `save_pretrained`,
prompts that cross the window / the original context, prefill + 16 greedy steps compared in fp32 (tokens
and logits, max difference printed), several prompts batched together (batch invariance).
"""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.config import ModelConfig  # noqa: E402
from ferrylm.errors import ConfigError  # noqa: E402
from ferrylm.models.deepseek import DeepseekForCausalLM  # noqa: E402

from helpers import capture_logits  # noqa: E402

STEPS = 16
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(tmp_path_factory, name: str, cfg_name: str, cls_name: str, extra: dict, std: float = 0.08):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # random init is tiny; widen it so differences in the math would show
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, std)
        for name, b in model.named_buffers():  # DeepSeek-V3's router correction bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path), model


def reference(model, prompt: list[int]):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)  # tokens, [steps, V]


def prompts_of(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in lengths]


def compare(name, path, ref_model, prompts, tol=1e-4, repeat=False, **llm_kwargs) -> float:
    """All prompts in one batch through ferrylm vs each alone through transformers; returns the max diff.
    `repeat` runs the batch twice so the second pass reads its prompts from the prefix cache."""
    refs = [reference(ref_model, p) for p in prompts]
    llm = LLM(path, **{"dtype": "float32", "max_num_seqs": 8, **llm_kwargs})
    worst = 0.0
    for attempt in range(2 if repeat else 1):
        with capture_logits(llm.engine) as got:
            res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
        by_seq: dict[int, list] = {}
        for sid, row in got:
            by_seq.setdefault(sid, []).append(row.float().cpu())
        rows = [torch.stack(v) for _, v in sorted(by_seq.items())]  # per sequence [steps, V], in prompt order
        for i, ((ref_tokens, ref_logits), r, ours) in enumerate(zip(refs, res, rows)):
            scale = ref_logits.abs().max().item()
            diff = (ours - ref_logits).abs().max().item()
            worst = max(worst, diff)
            print(f"{name} pass {attempt} prompt {i} (len {len(prompts[i])}): max |logit diff| = {diff:.3e} "
                  f"(logit scale {scale:.2f})")
            assert r.outputs[0].token_ids == ref_tokens, f"{name}: prompt {i} tokens differ"
            assert diff <= tol * max(1.0, scale)
    if repeat:
        assert llm.engine.scheduler.block_manager.prefix_hits > 0, "the second pass should hit the prefix cache"
    return worst


# -- sliding window ----------------------------------------------------------------------------------

WINDOW_FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # layer 0 full, layer 1 windowed: per-layer windows
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                               max_window_layers=1)),
    "mixtral-window": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=8, num_local_experts=4,
                                                                   num_experts_per_tok=2)),
}


@pytest.mark.parametrize("family", list(WINDOW_FAMILIES))
def test_sliding_window_matches_transformers(family, tmp_path_factory):
    path, ref = build(tmp_path_factory, family, *WINDOW_FAMILIES[family])
    # prompts shorter than, equal to and past the window; decode crosses it in every case
    compare(family, path, ref, prompts_of(5, 8, 21), repeat=True, block_size=4)


def test_sliding_window_chunked_prefill(tmp_path_factory):
    path, ref = build(tmp_path_factory, "mistral-chunked", *WINDOW_FAMILIES["mistral"])
    # 8-token budget: the 21- and 30-token prompts arrive in chunks that start past the window
    compare("mistral chunked", path, ref, prompts_of(21, 30), block_size=4, max_num_batched_tokens=8,
            max_num_seqs=2)


def test_sliding_window_config():
    base = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, num_attention_heads=4,
                num_hidden_layers=4, vocab_size=10, sliding_window=4096)
    assert ModelConfig.from_hf(base).sliding_window is None  # Qwen's window counts only when used
    on = ModelConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert [on.window_of(i) for i in range(4)] == [None, None, 4096, 4096]
    mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    assert [mistral.window_of(i) for i in range(4)] == [4096] * 4
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**base, "use_sliding_window": True, "layer_types": ["chunked_attention"] * 4})


def test_config_without_architectures_takes_the_model_type():
    """transformers' Auto classes read `model_type` when `architectures` is absent; so does ferrylm."""
    base = dict(model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=10)
    assert ModelConfig.from_hf(base).architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(ConfigError, match="'gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="architectures"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "model_type"})


def test_padded_decode_window_mask_matches_exact():
    """The CUDA-graph decode pads the context to a bucket and masks by length: same output on the CPU."""
    from ferrylm.kv.cache import KVCache
    from ferrylm.layers.attention import PagedAttention

    torch.manual_seed(0)
    bs, H, Hk, D = 4, 4, 2, 8
    kv = KVCache(1, 16, bs, Hk, D, torch.float32, "cpu")
    kv.k.normal_()
    kv.v.normal_()
    attn = PagedAttention(0, H, Hk, D, D ** -0.5, sliding_window=5)
    q = torch.randn(3, H, D)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    lens = torch.tensor([13, 3, 9])
    k_cache, v_cache = kv.layer(0)
    exact = attn._decode(q, k_cache, v_cache, tables, lens, 13, padded=False)
    padded = attn._decode(q, k_cache, v_cache, tables, lens, 16, padded=True)
    for b in range(3):  # plain reference: the last min(5, len) keys of the row, softmax over them
        n = int(lens[b])
        keys = k_cache[tables[b]].flatten(0, 1)[max(0, n - 5):n].repeat_interleave(H // Hk, 1)  # [w, H, D]
        vals = v_cache[tables[b]].flatten(0, 1)[max(0, n - 5):n].repeat_interleave(H // Hk, 1)
        w = torch.softmax(torch.einsum("hd,whd->hw", q[b], keys) * D ** -0.5, dim=-1)
        ref = torch.einsum("hw,whd->hd", w, vals)
        assert (exact[b] - ref).abs().max() < 1e-5
    assert (padded - exact).abs().max() < 1e-5
    # rows of length 13 and 9 with W = 5: block 0 (positions 0-3) is before both windows and is skipped
    rows = torch.tensor([0, 2])
    skipped = attn._decode(q[rows], k_cache, v_cache, tables[rows], lens[rows], 13, padded=False, first=1)
    assert (skipped - exact[rows]).abs().max() < 1e-5


# -- RoPE scalings -----------------------------------------------------------------------------------

ROPE = {  # head_dim 16 -> 8 frequencies; original context 32, prompts and decode run past it
    "yarn": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)),
    "yarn-mscale": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=16,
        beta_slow=2, attention_factor=1.3)),
    "dynamic": dict(max_position_embeddings=32, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                      factor=2.0)),
    "longrope": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
        short_factor=[1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0], long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0])),
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_matches_transformers(kind, tmp_path_factory):
    path, ref = build(tmp_path_factory, f"rope-{kind}", "LlamaConfig", "LlamaForCausalLM",
                      dict(head_dim=16, **ROPE[kind]))
    # 20: crosses the original context while decoding; 40: past it from the prompt on
    compare(f"rope {kind}", path, ref, prompts_of(20, 40), repeat=True)


def test_rope_scaling_errors_name_the_key():
    from ferrylm.layers.rotary import RotaryEmbedding

    with pytest.raises(ConfigError, match="unsupported rope_scaling type 'mrope'"):
        RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "mrope"})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="long_factor"):
        RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "longrope", "original_max_position_embeddings": 32,
                                               "short_factor": [1.0] * 8})


def _llama3_rope_factors(head_dim: int, theta: float, s: dict) -> list[float]:
    """The divisors llama.cpp's converter stores as `rope_freqs` for llama3 scaling (written independently)."""
    import math

    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < s["original_max_position_embeddings"] / s["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > s["original_max_position_embeddings"] / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return out


def test_gguf_rope_freqs_match_llama3_scaling(tmp_path_factory):
    """A Llama-3.1 GGUF carries its rope scaling as the `rope_freqs` tensor, not as metadata."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rs = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
    path, ref = build(tmp_path_factory, "llama31", "LlamaConfig", "LlamaForCausalLM",
                      dict(head_dim=16, rope_parameters=rs))
    c = ref.config
    sd = {k: v.float().numpy() for k, v in ref.state_dict().items()}

    def permute(w, n):  # llama.cpp's q/k row order for its interleaved rope
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    out = tmp_path_factory.mktemp("gguf") / "llama31.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, v in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                   ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                   ("attention.head_count", c.num_attention_heads),
                   ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("llama.rope.freq_base", rs["rope_theta"])
    w.add_tensor("rope_freqs.weight", np.array(_llama3_rope_factors(16, rs["rope_theta"], rs), dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = dict(attn_norm="input_layernorm", ffn_norm="post_attention_layernorm", attn_q="self_attn.q_proj",
                 attn_k="self_attn.k_proj", attn_v="self_attn.v_proj", attn_output="self_attn.o_proj",
                 ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")
    for layer in range(c.num_hidden_layers):
        for g, h in names.items():
            t = sd[f"model.layers.{layer}.{h}.weight"]
            if g in ("attn_q", "attn_k"):
                t = permute(t, c.num_attention_heads if g == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    compare("gguf rope_freqs", str(out), ref, prompts_of(20, 40))


# -- optional biases ---------------------------------------------------------------------------------

BIASES = {
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen3-attention-bias": ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True, head_dim=16)),
    "qwen3_moe-attention-bias": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        attention_bias=True, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
}


@pytest.mark.parametrize("family", list(BIASES))
def test_biases_match_transformers(family, tmp_path_factory):
    path, ref = build(tmp_path_factory, family, *BIASES[family])
    compare(family, path, ref, prompts_of(11, 6))


# -- OLMoE -------------------------------------------------------------------------------------------

OLMOE = {  # norm_topk_prob stays at OLMoE's default (off); clip_qkv and biases on
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=1, clip_qkv=0.3, attention_bias=True),
}


@pytest.mark.parametrize("variant", list(OLMOE))
def test_olmoe_matches_transformers(variant, tmp_path_factory):
    path, ref = build(tmp_path_factory, variant, "OlmoeConfig", "OlmoeForCausalLM", OLMOE[variant])
    compare(variant, path, ref, prompts_of(11, 19))


# -- DeepSeek-V2 / V3 (MLA) --------------------------------------------------------------------------

MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32, n_shared_experts=1,
           num_experts_per_tok=2, num_hidden_layers=3, first_k_dense_replace=1, max_position_embeddings=256)
DEEPSEEK = {
    "deepseek_v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, n_routed_experts=8, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.0)),
    "deepseek_v2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, n_routed_experts=8, topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=24,
        routed_scaling_factor=2.0)),
    # grouped sigmoid routing with the correction bias, q LoRA, yarn with mscale_all_dim (softmax scale)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MLA, n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=24, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             mscale=1.0, mscale_all_dim=0.707, beta_fast=32, beta_slow=1))),
    "deepseek_v3-no-interleave": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MLA, n_routed_experts=8, n_group=2, topk_group=1, rope_interleave=False, attention_bias=True)),
}


@pytest.mark.parametrize("family", list(DEEPSEEK))
def test_deepseek_matches_transformers(family, tmp_path_factory):
    path, ref = build(tmp_path_factory, family, *DEEPSEEK[family])
    # 40 crosses the yarn case's original context (32); the second pass reads its prompts from the prefix
    # cache (prefill offset by cached latents); 8-token budget: the 40-token prompt arrives in chunks
    compare(family, path, ref, prompts_of(11, 40), repeat=True, block_size=4, max_num_batched_tokens=8)
    ours = DeepseekForCausalLM(ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text())))
    assert ours.model.layers[0].self_attn.attn.scale == pytest.approx(ref.model.layers[0].self_attn.scaling, rel=1e-6)


def test_deepseek_config_errors_name_the_key():
    base = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64, vocab_size=10,
                num_attention_heads=4, num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, n_routed_experts=8)
    for extra, key in ((dict(topk_method="greedy"), "topk_method"), (dict(scoring_func="softmax"), "scoring_func"),
                       (dict(n_group=3), "n_group")):
        with pytest.raises(ConfigError, match=key):
            DeepseekForCausalLM(ModelConfig.from_hf({**base, **extra}))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "kv_lora_rank"})


def test_mla_cache_holds_the_latent_only(tmp_path_factory):
    """One row of kv_lora_rank + qk_rope_head_dim per token and layer, no V: not H * (n + r + v) x 2."""
    path, _ = build(tmp_path_factory, "deepseek_v3-cache", *DEEPSEEK["deepseek_v3"])
    llm = LLM(path, dtype="float32", max_num_seqs=2, num_kv_blocks=8, block_size=4)
    kv = llm.engine.runner.kv_cache
    assert tuple(kv.k.shape) == (3, 9, 4, 1, 32 + 8) and kv.v.numel() == 0
    from ferrylm.plan.memory import kv_bytes_per_block  # the planner counts what the engine allocates

    assert kv_bytes_per_block(llm.engine.model_config, 4, "float32") * 9 == kv.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("family", ["mistral", "qwen2-window", "olmoe", "deepseek_v3"])
@pytest.mark.parametrize("eager", [False, True])
def test_on_cuda_matches_transformers(family, eager, tmp_path_factory):
    """On the GPU: the windowed Llama family (and OLMoE with the fused expert backend) runs decode steps
    as CUDA graphs (padded_decode masks) unless eager; DeepSeek runs eagerly. Against transformers on CPU."""
    spec = {**WINDOW_FAMILIES, **DEEPSEEK, "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", OLMOE["olmoe"])}[family]
    path, ref = build(tmp_path_factory, f"cuda-{family}", *spec)
    compare(f"cuda {family} eager={eager}", path, ref, prompts_of(5, 21, 40), tol=1e-3, repeat=True, block_size=4,
            device="cuda", enforce_eager=eager)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_deepseek_routers_match_transformers(version):
    """Many tokens through the routers alone: the same experts (as sets) and weights as transformers'."""
    from ferrylm.layers.moe import route_group_limited, route_sigmoid_biased

    torch.manual_seed(0)
    E, H, k, G, TG = 16, 32, 4, 4, 2
    if version == "v2":
        cfg = transformers.DeepseekV2Config(n_routed_experts=E, hidden_size=H, num_experts_per_tok=k, n_group=G,
                                            topk_group=TG, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(cfg)
    else:
        cfg = transformers.DeepseekV3Config(n_routed_experts=E, hidden_size=H, num_experts_per_tok=k, n_group=G,
                                            topk_group=TG, routed_scaling_factor=2.5, norm_topk_prob=True)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
        router.e_score_correction_bias.normal_(0, 0.2)
    router.weight.data.normal_(0, 0.5)
    x = torch.randn(2000, H)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
        if version == "v2":
            w, ids = route_group_limited(logits, k, G, TG, normalize=False, scale=16.0)
        else:
            w, ids = route_sigmoid_biased(logits, router.e_score_correction_bias, k, G, TG, True, 2.5)
    ref_order, order = ref_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ref_ids.gather(1, ref_order), ids.gather(1, order))
    diff = (ref_w.gather(1, ref_order) - w.gather(1, order)).abs().max().item()
    print(f"deepseek {version} router: max |weight diff| over 2000 tokens = {diff:.3e}")
    assert diff < 1e-6
