"""GGUFSource: header parsing, config translation, name mapping, dequantization and the q/k un-permute,
against transformers' own GGUF loader and against synthetic files written with gguf.GGUFWriter."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from ferrylm.config import ModelConfig
from ferrylm.default_model import default_model_path
from ferrylm.errors import ModelLoadError, UnsupportedArchitectureError
from ferrylm.weights.gguf import GGUFSource, read_gguf_metadata

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smol_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def smol(smol_path):
    with GGUFSource(smol_path) as src:
        yield src


def test_default_model_path_points_at_the_embedded_gguf(smol_path):
    assert os.path.isfile(smol_path) and smol_path.endswith(".gguf")


def test_config_translation(smol):
    c = smol.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0
    assert c["max_position_embeddings"] == 8192 and c["vocab_size"] == 49152
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in smol.keys()
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert c["torch_dtype"] == "bfloat16"  # quantized file
    mc = ModelConfig.from_hf(c)
    assert mc.architecture == "LlamaForCausalLM" and mc.eos_token_ids == (2,) and mc.head_dim == 64


def test_header_agrees_with_gguf_reader(smol_path, smol):
    reader = gguf.GGUFReader(smol_path)
    meta = read_gguf_metadata(smol_path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = meta[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert len(reader.tensors) == len(smol.tensors)
    for a, b in zip(reader.tensors, smol.tensors):
        assert (a.name, list(a.shape), int(a.tensor_type), int(a.data_offset), int(a.n_bytes)) == (
            b.name, list(b.dims), b.ggml_type, b.offset, b.nbytes)


def test_every_tensor_equals_transformers(smol, hf_smollm2):
    """transformers dequantizes the same file and reverse-permutes q/k; every tensor must agree exactly."""
    ref = hf_smollm2.state_dict()
    assert set(smol.keys()) == set(ref) - {"lm_head.weight"}  # tied: HF lists the alias, the file does not
    max_diff = 0.0
    for name in smol.keys():
        ours = smol.get(name).float()
        assert ours.shape == ref[name].shape, name
        max_diff = max(max_diff, (ours - ref[name]).abs().max().item())
    print(f"max |ferrylm - transformers| over {len(smol.keys())} tensors: {max_diff}")
    assert max_diff == 0.0
    # the un-permute matters: the raw (permuted) rows differ from HF's
    q = smol.get("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(_permute(q, 9), q)


def test_packed_tensors_of_the_embedded_default_hold_the_dequantized_values(smol):
    """Every Q4_1 / Q8_0 matrix of the embedded default, handed out packed, dequantizes bit for bit to what
    `get()` (gguf's dequantizer, q/k un-permuted) gives; packed bytes stay within the block sizes."""
    names = [n for n in smol.keys() if smol.get_quantized(n) is not None]
    assert len(names) == 211  # 30 layers x 7 matrices + the Q8_0 embedding
    for name in names[:: 7] + ["model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight",
                               "model.layers.3.self_attn.k_proj.weight"]:
        qt = smol.get_quantized(name)
        assert torch.equal(qt.dequantize(torch.float32), smol.get(name)), name
        per_value = {"Q4_1": 20 / 32, "Q8_0": 34 / 32}[smol.ggml_type(name)]
        assert qt.nbytes == int(qt.shape[0] * qt.shape[1] * per_value), name
    assert smol.get_quantized("model.norm.weight") is None


@pytest.mark.parametrize("n_bytes", [0, 3, 100, 1_000_000, 1_786_000, 50_000_000, -1])
def test_truncated_file_is_a_clear_error(smol_path, tmp_path, n_bytes):
    size = os.path.getsize(smol_path)
    n = size + n_bytes if n_bytes < 0 else n_bytes
    bad = tmp_path / "cut.gguf"
    with open(smol_path, "rb") as f, open(bad, "wb") as g:
        g.write(f.read(n))
    with pytest.raises(ModelLoadError) as e:
        GGUFSource(str(bad))
    assert str(bad) in str(e.value)
    assert "truncated" in str(e.value) or "empty" in str(e.value) or "not a GGUF" in str(e.value)


def test_missing_and_wrong_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        GGUFSource(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="directory"):
        GGUFSource(str(tmp_path))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFSource(str(junk))


# ---------------------------------------------------------------------------------------------------
# Synthetic files
# ---------------------------------------------------------------------------------------------------

H, NH, NKV, D, FF, V = 64, 4, 2, 16, 256, 48  # hidden, heads, kv heads, head dim, ffn, vocab


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written independently of ferrylm's inverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_blocks(rows: int, cols: int, qt, seed: int) -> np.ndarray:
    """Random but finite Q4_K / Q6_K blocks (numpy cannot quantize to K types)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qt == Q.Q4_K:  # d, dmin (f16) first
        blocks[..., 0:2] = half
        blocks[..., 2:4] = half
    else:  # Q6_K: d (f16) last
        blocks[..., -2:] = half
    return blocks.reshape(rows, -1)


def _write(path, arch: str, tensors: dict, extra_kv=None, experts: int = 0):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.context_length", 256)
    w.add_uint32(f"{arch}.embedding_length", H)
    w.add_uint32(f"{arch}.feed_forward_length", FF)
    w.add_uint32(f"{arch}.attention.head_count", NH)
    w.add_uint32(f"{arch}.attention.head_count_kv", NKV)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_uint32(f"{arch}.vocab_size", V)
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_feed_forward_length", FF)
    for k, v in (extra_kv or {}).items():
        w.add_uint32(k, v)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_synthetic_llama_roundtrip(tmp_path):
    """Every storage type round-trips: exactly equal to gguf's own dequantize of the stored blocks, within
    quantization tolerance of the original values, q/k un-permuted, shapes in HF order."""
    g = torch.Generator().manual_seed(0)
    hf = {  # HF name -> original float32 values
        "model.embed_tokens.weight": torch.randn(V, H, generator=g),
        "model.norm.weight": torch.rand(H, generator=g) + 0.5,
        "lm_head.weight": torch.randn(V, H, generator=g),
        "model.layers.0.input_layernorm.weight": torch.rand(H, generator=g),
        "model.layers.0.post_attention_layernorm.weight": torch.rand(H, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(NH * D, H, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(NKV * D, H, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(NKV * D, H, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(H, NH * D, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(FF, H, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(FF, H, generator=g),
    }
    gguf_names = {
        "model.embed_tokens.weight": ("token_embd.weight", Q.F16),
        "model.norm.weight": ("output_norm.weight", Q.F32),
        "lm_head.weight": ("output.weight", Q.BF16),
        "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", Q.F32),
        "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", Q.F32),
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", Q.Q8_0),
        "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", Q.Q4_0),
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", Q.Q4_1),
        "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", Q.Q8_0),
        "model.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", Q.Q5_0),
        "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", Q.Q4_0),
    }
    tensors, expected = {}, {}
    for name, values in hf.items():
        gname, qt = gguf_names[name]
        stored = values
        if name.endswith("q_proj.weight"):
            stored = _permute(values, NH)
        elif name.endswith("k_proj.weight"):
            stored = _permute(values, NKV)
        arr = stored.numpy()
        if qt == Q.F32:
            tensors[gname] = (arr, None)
        elif qt == Q.F16:
            tensors[gname] = (arr.astype(np.float16), None)
        else:
            tensors[gname] = (quantize(arr, qt), qt)
        back = torch.from_numpy(dequantize(tensors[gname][0], qt if qt != Q.F16 else Q.F16).copy()).float()
        if name.endswith("q_proj.weight"):
            back = _permute_inverse(back, NH)
        elif name.endswith("k_proj.weight"):
            back = _permute_inverse(back, NKV)
        expected[name] = back.reshape(values.shape)
    # K-quants (numpy cannot quantize them): random finite blocks, compared with gguf's dequantize
    for hf_name, gname, qt, seed in (("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", Q.Q4_K, 1),):
        blocks = _k_quant_blocks(H, FF, qt, seed)
        tensors[gname] = (blocks, qt)
        expected[hf_name] = torch.from_numpy(dequantize(blocks, qt).copy())
    path = tmp_path / "tiny-llama.gguf"
    _write(path, "llama", tensors)

    with GGUFSource(str(path)) as src:
        assert set(src.keys()) == set(expected)
        assert src.config["tie_word_embeddings"] is False
        assert src.config["torch_dtype"] == "bfloat16"
        assert src.get("model.embed_tokens.weight").dtype == torch.float16  # float storage keeps its dtype
        assert src.get("lm_head.weight").dtype == torch.bfloat16
        worst = {}
        for name, want in expected.items():
            got = src.get(name)
            assert got.shape == want.shape, name
            assert torch.isfinite(got.float()).all(), name
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0, msg=name)
            if name in hf:
                scale = hf[name].abs().max().item()
                err = (got.float() - hf[name]).abs().max().item() / scale
                worst[src.ggml_type(name)] = max(worst.get(src.ggml_type(name), 0.0), err)
        print("max relative error vs original values by storage type:", worst)
        for name, want in expected.items():  # Q4_0 / Q4_1 / Q8_0 also come packed, holding the same values
            qt = src.get_quantized(name)
            packed = src.ggml_type(name) in ("Q4_0", "Q4_1", "Q8_0")
            assert (qt is not None) == packed, name
            if packed:
                assert qt.shape == tuple(want.shape) and qt.row_wise
                torch.testing.assert_close(qt.dequantize(torch.float32), want.float(), rtol=0, atol=0, msg=name)
        tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.05, "Q4_1": 0.1, "Q4_0": 0.1}
        for t, err in worst.items():
            assert err <= tol[t], (t, err)


def _permute_inverse(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_q6_k_dequantizes_like_gguf(tmp_path):
    blocks = _k_quant_blocks(V, H * 4, Q.Q6_K, 2)
    path = tmp_path / "q6k.gguf"
    emb = blocks  # [V, H*4] of Q6_K
    _write(path, "qwen2", {"token_embd.weight": (emb, Q.Q6_K),
                           "blk.0.attn_q.bias": (np.arange(NH * D, dtype=np.float32), None)})
    with GGUFSource(str(path)) as src:
        got = src.get("model.embed_tokens.weight")
        assert got.shape == (V, H * 4) and got.dtype == torch.float32
        assert torch.equal(got, torch.from_numpy(dequantize(blocks, Q.Q6_K).copy()))
        # qwen2: no permutation, biases mapped, architecture translated
        assert torch.equal(src.get("model.layers.0.self_attn.q_proj.bias"), torch.arange(NH * D, dtype=torch.float32))
        assert src.config["architectures"] == ["Qwen2ForCausalLM"] and src.config["attention_bias"] is True


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    # Q8_1 exists in ggml (an activation format) but gguf.quants cannot dequantize it
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((4, H // block_elems * block_bytes), dtype=np.uint8)
    path = tmp_path / "q81.gguf"
    _write(path, "llama", {"token_embd.weight": (np.zeros((V, H), np.float32), None),
                           "blk.0.attn_q.weight": (raw, Q.Q8_1)})
    with pytest.raises(ModelLoadError) as e:
        GGUFSource(str(path))
    assert "blk.0.attn_q.weight" in str(e.value) and "Q8_1" in str(e.value) and str(path) in str(e.value)


def test_unknown_architecture_lists_supported(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write(path, "gpt2", {"token_embd.weight": (np.zeros((V, H), np.float32), None)})
    with pytest.raises(UnsupportedArchitectureError) as e:
        GGUFSource(str(path))
    assert "'gpt2'" in str(e.value) and "llama" in str(e.value) and "qwen3" in str(e.value)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_stacked_experts_split_per_expert(tmp_path, arch):
    E = 4
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(E, FF, H, generator=g)  # [E, R, C]
    down = torch.randn(E, H, FF, generator=g)
    router = torch.randn(E, H, generator=g)
    tensors = {
        "token_embd.weight": (np.zeros((V, H), np.float32), None),
        "blk.0.ffn_gate_inp.weight": (router.numpy(), None),
        "blk.0.ffn_gate_exps.weight": (quantize(gate.numpy(), Q.Q8_0), Q.Q8_0),
        "blk.0.ffn_down_exps.weight": (down.numpy(), None),
        "blk.0.attn_q_norm.weight": (np.ones(D, np.float32), None),
    }
    if arch == "qwen2moe":
        tensors["blk.0.ffn_gate_inp_shexp.weight"] = (np.ones(H, np.float32), None)
        tensors["blk.0.ffn_up_shexp.weight"] = (np.ones((FF, H), np.float32), None)
    path = tmp_path / f"{arch}.gguf"
    _write(path, arch, tensors, experts=E)
    with GGUFSource(str(path)) as src:
        c = src.config
        if arch == "llama":
            assert c["architectures"] == ["MixtralForCausalLM"] and c["num_local_experts"] == E
            gate_name, down_name, router_name = ("model.layers.0.block_sparse_moe.experts.{}.w1.weight",
                                                 "model.layers.0.block_sparse_moe.experts.{}.w2.weight",
                                                 "model.layers.0.block_sparse_moe.gate.weight")
        else:
            assert c["num_experts"] == E and c["moe_intermediate_size"] == FF and c["num_experts_per_tok"] == 2
            gate_name, down_name, router_name = ("model.layers.0.mlp.experts.{}.gate_proj.weight",
                                                 "model.layers.0.mlp.experts.{}.down_proj.weight",
                                                 "model.layers.0.mlp.gate.weight")
        mc = ModelConfig.from_hf(c)
        assert mc.num_experts == E and mc.is_moe
        deq = torch.from_numpy(dequantize(quantize(gate.numpy(), Q.Q8_0), Q.Q8_0).copy())
        for e in range(E):
            assert torch.equal(src.get(gate_name.format(e)), deq[e])
            assert torch.equal(src.get(down_name.format(e)), down[e])
        assert torch.equal(src.get(router_name), router)
        if arch == "qwen2moe":
            assert src.get("model.layers.0.mlp.shared_expert_gate.weight").shape == (1, H)
            assert "model.layers.0.mlp.shared_expert.up_proj.weight" in src.keys()
        if arch == "qwen3moe":
            assert c["norm_topk_prob"] is True and mc.qk_norm
            assert "model.layers.0.self_attn.q_norm.weight" in src.keys()


def test_source_closes_and_refuses_reads(tmp_path, smol_path):
    copy = tmp_path / "m.gguf"
    shutil.copy(smol_path, copy)
    src = GGUFSource(str(copy))
    t = src.get("model.norm.weight")
    src.close()
    assert t.shape == (576,)  # a returned tensor owns its memory, independent of the map
    with pytest.raises(ModelLoadError, match="closed"):
        src.get("model.norm.weight")
