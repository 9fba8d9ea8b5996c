"""Model features against transformers: sliding-window attention, RoPE scalings, optional biases and the
newer families (OLMoE, DeepSeek-V2/V3). Tiny random-weight checkpoints written by `save_pretrained`,
prompts that cross the window / the original context, prefill + 16 greedy steps compared in fp32 (tokens
and logits, max difference printed), several prompts batched together (batch invariance).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.config import ModelConfig  # noqa: E402
from ferrylm.errors import ConfigError  # noqa: E402

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
            by_seq.setdefault(sid, []).append(row)
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
