"""`ferry convert` options the CPU fast path adds: `--quant q8_0` (group-wise int8 at 32, llama.cpp's Q8_0,
computed by the `int8group` kernel) and `--dequantize` (a GGUF's packed blocks written dense)."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.weights import store as S  # noqa: E402
from ferrylm.weights.convert import ConvertOptions, add_convert_parser, convert  # noqa: E402

from helpers import capture_logits  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 200, 7, 64, 11]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = str(tmp_path_factory.mktemp("llama"))
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)} | {"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w2", "bos_token": "w1"}, f)
    return path


def _logits(path) -> torch.Tensor:
    llm = LLM(path, dtype="float32", max_num_seqs=1)
    with capture_logits(llm.engine) as got:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return torch.stack([row for _, row in got])  # [steps, V]


def test_q8_0_store_runs_on_the_group_kernel(llama, tmp_path, monkeypatch):
    dst = str(tmp_path / "q8")
    rep = convert(llama, dst, ConvertOptions(quant="q8_0"))
    st = S.StoreSource(dst)
    qt = st.get_quantized("model.layers.0.mlp.down_proj.weight")
    assert qt.scheme == "int8" and qt.params == {"group_size": 32}
    assert st.get_quantized("model.embed_tokens.weight") is None  # embeddings stay in high precision
    assert max(e for _, e in rep.errors["q8_0"]) < 0.01  # relative error of Q8_0 on gaussian weights ~0.4%
    llm = LLM(dst, dtype="float32", max_num_seqs=1)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert [k.name for k in qkv.kernels] == ["int8group"] and qkv.packed_shards == ["q", "k", "v"]
    packed = _logits(dst)
    monkeypatch.setattr(S.StoreSource, "get_quantized", lambda self, name: None)  # the plain path
    dense = _logits(dst)
    diff = (packed - dense).abs().max().item()
    print(f"q8_0 store: max |logit diff| int8group kernel vs dequantized dense = {diff:.3e}")
    assert diff < 2e-2 * dense.abs().max().item()  # bf16 activations in the kernel


def test_cli_knows_q8_0_and_dequantize():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_convert_parser(sub)
    a = p.parse_args(["src", "dst", "--quant", "q8_0", "--dequantize"])
    assert a.quant == "q8_0" and a.dequantize


def test_dequantize_writes_a_gguf_dense(tmp_path):
    from ferrylm.default_model import default_model_path
    from ferrylm.weights.gguf import GGUFSource

    try:
        gguf = default_model_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")
    dst = str(tmp_path / "dense")
    rep = convert(gguf, dst, ConvertOptions(dequantize=True, dtype="bfloat16"))
    assert rep.packed == 0 and rep.quantized == 0
    st = S.StoreSource(dst)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert st.get_quantized(name) is None
    with GGUFSource(gguf) as g:
        assert torch.equal(st.get(name), g.get(name).to(torch.bfloat16))
