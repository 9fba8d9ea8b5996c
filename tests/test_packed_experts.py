"""Packed experts (kept in their store format for the fused kernel): stacking per bank, the per-expert
dequantization the reference path reads, and the loader keeping a quantized store's experts packed.
The kernel itself is tested in tests/test_fused_moe_formats.py and the engine on CUDA in tests/test_cuda.py."""

import pytest
import torch

from ferrylm.layers.fused_moe import ExpertWeights, expert_format
from ferrylm.weights import quant
from ferrylm.weights.convert import ConvertOptions, convert
from ferrylm.weights.source import open_source


@pytest.mark.parametrize("make", [lambda t: quant.quantize_int8(t), lambda t: quant.quantize_int4(t, 32, "min"),
                                  lambda t: quant.quantize_nf4(t, 64), lambda t: quant.quantize_fp8(t),
                                  lambda t: quant.quantize_fp8(t, 32)])
def test_stacked_bank_dequantizes_like_its_pieces(make):
    torch.manual_seed(0)
    E, N, K = 3, 16, 128
    pieces = [[make(torch.randn(N, K)), make(torch.randn(N, K))] for _ in range(E)]
    bank = ExpertWeights.stack(pieces, torch.float32)
    assert bank.shape == (E, 2 * N, K)
    dense = bank.dequantize(torch.float32)
    for e, (a, b) in enumerate(pieces):
        assert torch.equal(dense[e], torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)]))
        assert torch.equal(bank.expert(e).dequantize(torch.float32)[0], dense[e])
    assert bank.nbytes == sum(p.nbytes for ps in pieces for p in ps)


def test_nf4_groups_must_tile_rows():
    qt = quant.quantize_nf4(torch.randn(4, 96), 64)  # 96 % 64 != 0: groups straddle rows
    assert expert_format(qt) is None
    assert expert_format(quant.quantize_nf4(torch.randn(4, 128), 64)) == "nf4"


@pytest.mark.parametrize("scheme,packs", [("int8", True), ("int4", True), ("fp8", True), ("nf4", False)])
def test_loader_keeps_a_quantized_stores_experts_packed(scheme, packs, tmp_path_factory):
    """A packing bank holds exactly what the dequantize-at-load path computes, at a fraction of the bytes.
    NF4's groups of 64 do not tile this model's 96-wide rows: that bank stays dense."""
    from test_models_hf import build

    from ferrylm.config import ModelConfig
    from ferrylm.models.registry import model_class

    path, _ = build(tmp_path_factory, "mixtral")
    store = str(tmp_path_factory.mktemp(f"store-{scheme}") / "s")
    convert(path, store, ConvertOptions(quant=scheme, group_size=32 if scheme == "int4" else 64))
    cfg = ModelConfig.from_hf(open_source(store).config)

    def load(pack: bool):
        src = open_source(store)
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        banks = model.pack_experts(src) if pack else []
        model.load_weights(src)
        return model, banks

    dense, _ = load(False)
    packed, banks = load(True)
    assert len(banks) == (cfg.num_hidden_layers if packs else 0)
    for name in banks:
        a, b = dense.get_submodule(name), packed.get_submodule(name)
        assert b.packed is not None and b.w13.numel() == 0
        assert b.packed[0].nbytes + b.packed[1].nbytes < (a.w13.numel() + a.w2.numel()) * a.w13.element_size() / 2
        for e in range(a.num_experts):
            for x, y in zip(a.expert_weights(e), b.expert_weights(e)):
                assert torch.equal(x, y)


def test_random_source_hands_out_packed_experts():
    """The benchmarks' random source in packed-expert mode: per-expert names the loader packs (or dequantizes)."""
    from ferrylm.config import ModelConfig
    from ferrylm.models.registry import model_class
    from ferrylm.weights.random_source import RandomSource

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64, "hidden_size": 128,
           "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    mc = ModelConfig.from_hf(cfg)
    for scheme in ("int8", "int4", "nf4", "fp8", "fp8-g128"):
        if scheme == "fp8-g128":  # groups of 128 along both w13's and w2's rows
            cfg, mc = {**cfg, "intermediate_size": 256, "hidden_size": 128}, ModelConfig.from_hf({**cfg, "intermediate_size": 256})
        src = RandomSource(cfg, dtype=torch.float32, expert_quant=scheme)
        with torch.device("meta"):
            model = model_class(mc)(mc)
        assert len(model.pack_experts(src)) == 2  # (models/base.py ENGINE_PACKED_FORMATS)
        model.load_weights(src)
        bank = model.model.layers[0].block_sparse_moe.experts
        assert bank.packed[0].fmt == scheme.split("-")[0] and bank.packed[0].shape == (4, 2 * mc.intermediate_size, 128)
        if scheme == "fp8-g128":
            assert (bank.packed[0].group, bank.packed[1].group) == (128, 128)
        w13, w2 = bank.expert_weights(1)
        assert 0.01 < w13.float().std().item() < 0.04 and 0.01 < w2.float().std().item() < 0.04


def test_random_source_packs_yuan_m32_experts():
    """Yuan M32 checkpoints stack each expert's gate and up rows in one `w1`: the random source names them so."""
    from ferrylm.config import ModelConfig
    from ferrylm.models.registry import model_class
    from ferrylm.plan.yuan_sizes import YUAN2_M32
    from ferrylm.weights.random_source import RandomSource

    cfg = dict(YUAN2_M32, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               attention_projection_size=128, vocab_size=512,
               moe_config=dict(YUAN2_M32["moe_config"], moe_num_experts=4, ffn_hidden_size=256))
    src = RandomSource(cfg, dtype=torch.float32, expert_quant="nf4")
    assert any(k.endswith("experts.3.w1.weight") for k in src.keys()) and not any(".w3." in k for k in src.keys())
    mc = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = model_class(mc)(mc)
    assert len(model.pack_experts(src)) == 2
    model.load_weights(src)
    bank = next(m for m in model.modules() if type(m).__name__ == "Experts")
    assert bank.packed[0].fmt == "nf4" and bank.packed[0].shape == (4, 512, 128)


def test_placement_counts_packed_linear_weights_at_their_packed_size(tmp_path_factory):
    from test_models_hf import build

    from ferrylm.config import ModelConfig
    from ferrylm.models.registry import model_class
    from ferrylm.offload.placement import group_tensors

    path, _ = build(tmp_path_factory, "llama3")
    store = str(tmp_path_factory.mktemp("store-int4") / "s")
    convert(path, store, ConvertOptions(quant="int4", group_size=32))
    src = open_source(store)
    cfg = ModelConfig.from_hf(src.config)
    with torch.device("meta"):
        dense, packed = model_class(cfg)(cfg), model_class(cfg)(cfg)
    assert packed.note_packed_linears(src) > 0
    by = {g.name: g.nbytes for g in group_tensors(dense)}
    for g in group_tensors(packed):
        if g.kind in ("attention", "mlp"):
            assert g.nbytes < by[g.name] * 0.4, g.name  # int4 codes + fp16 scales of fp32 weights


def test_gguf_packed_linear_bytes_without_decoding_equal_the_decoded_bytes():
    """The GGUF source's `quantized_info` (no block decode) sizes each Linear exactly as decoding would."""
    from ferrylm.config import ModelConfig
    from ferrylm.default_model import default_model_path
    from ferrylm.models.registry import model_class

    try:
        path = default_model_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")
    src = open_source(path)
    cfg = ModelConfig.from_hf(src.config)
    with torch.device("meta"):
        fast, slow = model_class(cfg)(cfg), model_class(cfg)(cfg)

    class Decoding:  # the same source without quantized_info: note_packed_linears decodes every block
        def __init__(self, s):
            self.s = s

        def keys(self):
            return self.s.keys()

        def get_quantized(self, name):
            return self.s.get_quantized(name)

    n = fast.note_packed_linears(src)
    assert n > 0 and n == slow.note_packed_linears(Decoding(src))
    got = {k: m.packed_nbytes for k, m in fast.named_modules() if getattr(m, "packed_nbytes", None)}
    assert got and got == {k: m.packed_nbytes for k, m in slow.named_modules() if getattr(m, "packed_nbytes", None)}


def test_a_bank_packed_on_one_side_only_is_a_clear_load_error():
    """Experts whose gate/up arrive packed but whose down projection arrives dense: ModelLoadError, not a traceback."""
    from ferrylm.config import ModelConfig
    from ferrylm.errors import ModelLoadError
    from ferrylm.models.registry import model_class
    from ferrylm.weights.random_source import RandomSource

    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64, "hidden_size": 128,
           "intermediate_size": 192, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 64}
    src = RandomSource(cfg, dtype=torch.float32, expert_quant="nf4")
    dense = lambda name: name.endswith(".w2.weight") and ".experts.1." in name  # noqa: E731
    packed_get, plain_get = src.get_quantized, src.get
    src.get_quantized = lambda name: None if dense(name) else packed_get(name)
    src.get = lambda name: torch.randn(128, 192) * 0.02 if dense(name) else plain_get(name)
    mc = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = model_class(mc)(mc)
    assert model.pack_experts(src)  # expert 0 is packed throughout, so the bank packs
    with pytest.raises(ModelLoadError, match="stored dense in a bank whose experts are packed"):
        model.load_weights(src)


def test_random_source_hands_out_packed_linears():
    """`linear_quant`: a dense model's decoder Linears come packed (the Qwen2-72B NF4 benchmark's source); the
    engine on the packed weights gives the logits of the same source dequantized (LM head and norms dense)."""
    from helpers import capture_logits

    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "tie_word_embeddings": False}
    src = RandomSource(cfg, dtype=torch.float32, linear_quant="nf4")
    assert len(src.linears) == 2 * 4 and not any("lm_head" in n or "embed" in n for n in src.linears)
    outs = []
    for packed in (True, False):
        s = RandomSource(cfg, dtype=torch.float32, linear_quant="nf4")
        if not packed:
            s.get_quantized = lambda name: None  # the same weights, loaded dense
        llm = LLM(s, device="cpu", dtype="float32", max_model_len=64)
        mlp = llm.engine.runner.model.model.layers[1].mlp.gate_up_proj
        assert bool(mlp.kernels) == packed and (mlp.weight.numel() == 0) == packed
        with capture_logits(llm.engine) as got:
            llm.generate([[3, 14, 15, 92, 65, 35]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        outs.append(torch.stack([row for _, row in got]))
        llm.close()
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"packed vs dequantized linears: max |logit diff| {diff:.2e}")
    assert diff < 1e-3 * outs[1].abs().max().item() + 1e-4
    with pytest.raises(ValueError, match="linear_quant"):
        RandomSource(cfg, linear_quant="q3")
