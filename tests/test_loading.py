"""Bad model paths and checkpoints: each a clear ModelLoadError naming the problem, nothing half-loaded."""

import json
import os
import shutil

import pytest

from ferrylm import LLM
from ferrylm.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError


def copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(d: str, **changes) -> None:
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def drop_tensors(d: str, *names: str) -> None:
    from safetensors.torch import load_file, save_file

    f = os.path.join(d, "model.safetensors")
    t = load_file(f)
    for n in names:
        del t[n]
    save_file(t, f)


def test_truncated_safetensors(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(ModelLoadError, match="truncated safetensors"):
        LLM(d)


def test_garbage_safetensors_header(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    with open(os.path.join(d, "model.safetensors"), "wb") as fh:
        fh.write(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(d)


def test_missing_config(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(d)


def test_unknown_architecture_lists_supported(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, architectures=["FancyNewForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*supported:.*LlamaForCausalLM"):
        LLM(d)


def test_checkpoint_missing_a_tensor(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    drop_tensors(d, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ModelLoadError, match="lacks tensors.*layers.1.mlp.down_proj"):
        LLM(d)


def test_shape_mismatch_names_the_tensor(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, intermediate_size=64)
    with pytest.raises(ModelLoadError, match="does not fit"):
        LLM(d)


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))


def test_bad_engine_options(tiny_llama):
    with pytest.raises(ConfigError, match="dtype"):
        LLM(tiny_llama, dtype="float8")
    with pytest.raises(ConfigError, match="max_model_len 100000 exceeds"):
        LLM(tiny_llama, max_model_len=100000)


@pytest.mark.parametrize("drop", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"])
def test_missing_shard_of_a_fused_projection(tiny_llama, tmp_path, drop):
    """q/k/v and gate/up fill one fused weight: each part must arrive, not just one of them."""
    d = copy_model(tiny_llama, tmp_path / "m")
    drop_tensors(d, drop)
    with pytest.raises(ModelLoadError, match="lacks tensors"):
        LLM(d)


def test_missing_one_expert(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    drop_tensors(str(tmp_path), "model.layers.0.block_sparse_moe.experts.2.w3.weight")
    with pytest.raises(ModelLoadError, match="lacks tensors.*experts.w13"):
        LLM(str(tmp_path))
