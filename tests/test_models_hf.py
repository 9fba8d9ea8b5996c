"""Every model family against transformers: tiny random-weight checkpoints written by `save_pretrained`
(the real on-disk tensor names), loaded by ferrylm, prefill + 16 greedy decode steps compared in fp32.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402

from helpers import capture_logits  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0, tie_word_embeddings=False)),
    "smollm2-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)),
}


def build(tmp_path_factory, family: str, **over) -> str:
    """A random `family` checkpoint (config `over` COMMON and the family's own) saved by transformers."""
    cfg_name, cls_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **over})
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # random init is tiny; widen it so differences in the math would show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return str(path), model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path_factory):
    path, ref = build(tmp_path_factory, family)
    prompt = [5, 17, 42, 99, 3, 200, 7, 64, 11, 150, 33]
    steps = 16
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ref_tokens = out.sequences[0, len(prompt):].tolist()
    ref_logits = torch.cat(out.logits)  # [steps, V]

    llm = LLM(path, dtype="float32", max_num_seqs=4)
    with capture_logits(llm.engine) as got:
        res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    ours = torch.stack([row for _, row in got])  # [steps, V]
    diff = (ours - ref_logits).abs().max().item()
    print(f"{family}: max |logit diff| over prefill + {steps - 1} decode steps = {diff:.3e}")
    assert res[0].outputs[0].token_ids == ref_tokens
    assert diff < 1e-4
