"""GGUF checkpoints: a llama.cpp `.gguf` file read as an HF-named, HF-shaped weight source.

Owns the GGUF container format (header, metadata, tensor table, memory-mapped data), the translation
of llama.cpp's metadata keys into an HF `config.json`-style dict, the mapping of llama.cpp tensor names
to HF names (llama, qwen2/3, their MoE variants, olmoe, deepseek2 with MLA, stacked experts split per
expert), dequantization (through `gguf.quants`) and undoing the converter's q/k row permutation of
llama-architecture files. It does not know models, devices or tokenization (`ferrylm/tokenizer.py` reads
the tokenizer from the same metadata through `read_gguf_metadata`).

The header is parsed here rather than with `gguf.GGUFReader`: the reader turns every vocabulary entry
into numpy arrays, which takes seconds on a 49k-token vocabulary, while this parser needs ~0.1 s and
reports truncation precisely. Tensor bytes stay memory-mapped until `get()` dequantizes one tensor.
`get_quantized()` hands Q4_0 / Q4_1 / Q8_0 matrices out still packed, as the `int4` / `int8` group-32
`QuantizedTensor`s that hold exactly the same values (only the nibble order within a block changes).

Dimension letters: E experts, R rows (output features), C columns (input features).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from ferrylm.errors import ModelLoadError, UnsupportedArchitectureError
from ferrylm.weights.quant import QuantizedTensor, pack_nibbles
from ferrylm.weights.source import WeightSource

# ---------------------------------------------------------------------------------------------------
# Container format
# ---------------------------------------------------------------------------------------------------

_MAGIC = b"GGUF"
# metadata value type -> struct format (little-endian prefix added at use)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_SCALAR = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_Q = gguf.GGMLQuantizationType
_INT_TYPES = {_Q.I8: np.int8, _Q.I16: np.int16, _Q.I32: np.int32, _Q.I64: np.int64, _Q.F64: np.float64}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    dims: tuple[int, ...]
    """GGUF order: `dims[0]` is the contiguous (fastest) axis. The torch shape is `dims` reversed."""
    ggml_type: int
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


class _Cursor:
    """Sequential reads from a buffer; running past its end means the file is truncated."""

    def __init__(self, buf, path: str, endian: str = "<"):
        self.buf, self.path, self.pos, self.e = buf, path, 0, endian
        self.size = len(buf)

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ModelLoadError(
                f"{self.path}: truncated GGUF file ({self.size} bytes; the header continues past the end)"
            )

    def unpack(self, fmt: str):
        n = struct.calcsize(self.e + fmt)
        self.need(n)
        out = struct.unpack_from(self.e + fmt, self.buf, self.pos)
        self.pos += n
        return out if len(out) > 1 else out[0]

    def unpack_tuple(self, fmt: str, count: int) -> tuple:
        if count == 0:
            return ()
        out = self.unpack(fmt * count)
        return out if count > 1 else (out,)

    def string(self, len_fmt: str = "Q") -> str:
        n = self.unpack(len_fmt)
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, len_fmt: str, skip_strings: bool = False):
        if vtype == 6:  # float32: the shortest decimal that round-trips (1e-05, not 9.99999974e-06)
            return float(str(np.float32(self.unpack("f"))))
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string(len_fmt)
        if vtype == _ARRAY:
            etype, count = self.unpack("I" + len_fmt)
            if etype in _NP_SCALAR:  # numbers: one vectorised read
                dt = np.dtype(self.e + _NP_SCALAR[etype])
                self.need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if etype == _STRING:
                if skip_strings:
                    for _ in range(count):
                        n = self.unpack(len_fmt)
                        self.need(n)
                        self.pos += n
                    return count
                return [self.string(len_fmt) for _ in range(count)]
            return [self.value(etype, len_fmt) for _ in range(count)]  # arrays of arrays
        raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (unknown value type {vtype})")


def _parse(buf, path: str, with_tensors: bool, skip_keys: tuple[str, ...] = ()):
    """-> (metadata dict, [GGUFTensorInfo]) from the mapped file `buf`."""
    head = bytes(buf[:8])
    if len(head) < 8 and _MAGIC.startswith(head[:4]):
        raise ModelLoadError(f"{path}: truncated GGUF file ({len(head)} bytes)")
    if head[:4] != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (missing 'GGUF' magic bytes)")
    endian = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # written on a big-endian host
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (1, 2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
    len_fmt = "I" if version == 1 else "Q"  # v1 used 32-bit counts and lengths
    cur = _Cursor(buf, path, endian)
    cur.pos = 8
    n_tensors, n_kv = cur.unpack(len_fmt + len_fmt)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string(len_fmt)
        vtype = cur.unpack("I")
        meta[key] = cur.value(vtype, len_fmt, skip_strings=key in skip_keys)
    if not with_tensors:
        return meta, []
    if endian == ">":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    raw = []
    for _ in range(n_tensors):
        name = cur.string(len_fmt)
        n_dims = cur.unpack("I")
        dims = tuple(int(d) for d in cur.unpack_tuple(len_fmt, n_dims))
        ggml_type, offset = cur.unpack("IQ")
        raw.append((name, dims, ggml_type, offset))
    align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = (cur.pos + align - 1) // align * align
    infos = []
    for name, dims, ggml_type, offset in raw:
        nbytes = _nbytes(path, name, dims, ggml_type)
        infos.append(GGUFTensorInfo(name, dims, ggml_type, data_start + offset, nbytes))
    end = max((t.offset + t.nbytes for t in infos), default=data_start)
    if end > len(buf):
        raise ModelLoadError(f"{path}: truncated GGUF file ({len(buf)} bytes, its tensor table needs {end})")
    return meta, infos


def _type_name(ggml_type: int) -> str:
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown ggml type {ggml_type}"


def _block(ggml_type: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block), or None for a type id the gguf package does not know."""
    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None


_readable_cache: dict[int, bool] = {}


def _readable(ggml_type: int) -> bool:
    """Whether `_load` can turn this type into values (probes the gguf package with one zero block)."""
    if ggml_type not in _readable_cache:
        blk = _block(ggml_type)
        ok = blk is not None
        if ok and _Q(ggml_type) not in (_Q.F32, _Q.F16, _Q.BF16, *_INT_TYPES):
            try:
                dequantize(np.zeros((1, blk[1]), dtype=np.uint8), _Q(ggml_type))
            except NotImplementedError:
                ok = False
            except Exception:  # e.g. a lazily built grid failing on the zero block: let get() decide
                ok = True
        _readable_cache[ggml_type] = ok
    return _readable_cache[ggml_type]


def _nbytes(path: str, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    blk = _block(ggml_type)
    if blk is None:
        raise ModelLoadError(f"{path}: tensor {name!r} has {_type_name(ggml_type)}, which ferrylm cannot read")
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block_elems, block_bytes = blk
    if dims and dims[0] % block_elems:
        raise ModelLoadError(f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of its block size")
    return n // block_elems * block_bytes


def _map(path: str) -> mmap.mmap:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, expected a .gguf file")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelLoadError(f"{path}: empty file, not a GGUF model")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None


def read_gguf_metadata(path: str, skip_string_arrays: tuple[str, ...] = ()) -> dict[str, Any]:
    """The metadata key/values of a .gguf file (no tensor data is touched).

    Keys named in `skip_string_arrays` come back as their element count instead of a list.
    """
    mm = _map(path)
    try:
        meta, _ = _parse(mm, path, with_tensors=False, skip_keys=skip_string_arrays)
        return meta
    except ModelLoadError:
        raise
    except Exception as e:  # struct/unicode surprises inside a corrupt header
        raise ModelLoadError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None
    finally:
        _unmap(mm)


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a numpy view of it is still alive (e.g. in a traceback); the GC will unmap it
        pass


# ---------------------------------------------------------------------------------------------------
# Metadata -> HF config
# ---------------------------------------------------------------------------------------------------

# GGUF `general.architecture` -> (HF architectures[0], model_type); llama with experts is Mixtral.
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # V3 too: sigmoid gating makes it V3 below
}
# Architectures whose converter permuted q/k rows for llama.cpp's interleaved rope (LlamaModel.permute).
# The others are written in HF's row order: qwen2moe/qwen3moe/olmoe use ggml's NEOX (rotate-half) rope,
# and deepseek2 uses ggml's interleaved rope on the unpermuted rows, which is HF DeepSeek's own rotation.
_PERMUTED_QK = {"llama"}
_SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID


def supported_gguf_architectures() -> list[str]:
    return sorted(_ARCHS)


def gguf_to_hf_config(meta: dict[str, Any], tensors: list[GGUFTensorInfo], path: str = "") -> dict:
    """Translate llama.cpp metadata keys into an HF config.json-style dict."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHS))}"
        )
    names = {t.name for t in tensors}

    def k(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hf_arch, model_type = _ARCHS[arch]
    n_experts = int(k("expert_count", 0) or 0)
    if arch == "llama" and n_experts:
        hf_arch, model_type = "MixtralForCausalLM", "mixtral"
    try:
        hidden = int(k("embedding_length"))
        heads = int(k("attention.head_count"))
        layers = int(k("block_count"))
    except TypeError:
        raise ModelLoadError(
            f"{path}: GGUF metadata lacks {arch}.embedding_length/attention.head_count/block_count") from None
    kv_heads = k("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some hybrids; dense models repeat one value
        kv_heads = max(kv_heads)
    head_dim = int(k("attention.key_length") or hidden // heads)
    vocab = k("vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else tokens
    if vocab is None:
        emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
        vocab = emb.shape[0] if emb is not None else None
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(k("feed_forward_length", 0) or 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(k("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(k("context_length", 4096)),
        "vocab_size": int(vocab) if vocab is not None else None,
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": _checkpoint_dtype(tensors),
    }
    rope_dim = k("rope.dimension_count")
    if rope_dim and int(rope_dim) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    scaling = k("rope.scaling.type")
    if scaling and scaling != "none":
        rs = {"rope_type": scaling, "factor": float(k("rope.scaling.factor", 1.0))}
        if k("rope.scaling.original_context_length"):
            rs["original_max_position_embeddings"] = int(k("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = rs
    if n_experts:
        cfg["num_experts_per_tok"] = int(k("expert_used_count", 0) or 0)
        if model_type == "mixtral":
            cfg["num_local_experts"] = n_experts
        else:
            cfg["num_experts"] = n_experts
            cfg["moe_intermediate_size"] = int(k("expert_feed_forward_length", 0) or 0)
            cfg["shared_expert_intermediate_size"] = int(k("expert_shared_feed_forward_length", 0) or 0)
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = []  # llama.cpp's qwen2moe/qwen3moe have no dense layers
            # llama.cpp's qwen3moe graph always renormalizes the top-k weights; qwen2moe and olmoe never do.
            cfg["norm_topk_prob"] = bool(k("expert_weights_norm", model_type == "qwen3_moe"))
    if arch == "olmoe" and k("attention.clamp_kqv") is not None:
        cfg["clip_qkv"] = float(k("attention.clamp_kqv"))
    if arch == "deepseek2":
        _deepseek_config(cfg, k, heads, n_experts, path)
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        v = meta.get(f"tokenizer.ggml.{gguf_key}")
        if v is not None:
            cfg[hf_key] = int(v)
    if "rope_freqs.weight" in names:
        # Llama 3.1-style rope scaling is stored as per-frequency factors, not as HF's parameters.
        cfg["gguf_rope_freqs"] = True
    cfg["gguf_architecture"] = arch
    return cfg


def _deepseek_config(cfg: dict, k, heads: int, n_experts: int, path: str) -> None:
    """MLA shapes and DeepSeek routing from deepseek2 metadata (`DeepseekV2Model` in convert_hf_to_gguf.py).

    Newer converters describe MLA as MQA over the latent (head_count_kv 1, key_length R + r) and keep the
    per-head sizes in `key_length_mla`/`value_length_mla`; older ones wrote the per-head sizes directly.
    """
    for key in ("rope.dimension_count", "attention.kv_lora_rank", "attention.key_length", "attention.value_length"):
        if k(key) is None:
            raise ModelLoadError(f"{path}: deepseek2 GGUF metadata lacks deepseek2.{key} (needed for MLA)")
    gating = k("expert_gating_func", 1)  # files from before the key are DeepSeek-V2/V2.5: softmax
    if gating not in (1, _SIGMOID_GATING):
        raise ModelLoadError(f"{path}: unsupported deepseek2.expert_gating_func {gating} (1 softmax, 2 sigmoid)")
    rope = int(k("rope.dimension_count"))
    key_len = int(k("attention.key_length_mla") or k("attention.key_length"))
    value_len = int(k("attention.value_length_mla") or k("attention.value_length"))
    v3 = gating == _SIGMOID_GATING
    n_group = int(k("expert_group_count", 1) or 1)
    cfg.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        num_key_value_heads=heads, head_dim=key_len,
        q_lora_rank=int(k("attention.q_lora_rank")) if k("attention.q_lora_rank") else None,
        kv_lora_rank=int(k("attention.kv_lora_rank")),
        qk_nope_head_dim=key_len - rope, qk_rope_head_dim=rope, v_head_dim=value_len,
        n_routed_experts=n_experts, n_shared_experts=int(k("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(k("expert_feed_forward_length", 0) or 0),
        first_k_dense_replace=int(k("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(k("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(k("expert_weights_norm", False)),
        n_group=n_group, topk_group=int(k("expert_group_used_count", 1) or 1),
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
        rope_interleave=True,  # ggml's deepseek2 graph rotates interleaved pairs
    )
    for key in ("partial_rotary_factor", "num_experts", "shared_expert_intermediate_size", "decoder_sparse_step",
                "mlp_only_layers"):
        cfg.pop(key, None)
    rs = cfg.get("rope_scaling")
    if rs and rs["rope_type"] == "yarn":
        # the converter stores 0.1 * mscale_all_dim; ggml's graph applies it as both mscale and
        # mscale_all_dim (the released configs have them equal), so the rotary attention factor is 1
        m = float(k("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rs.update(mscale=m, mscale_all_dim=m, beta_fast=float(k("rope.scaling.yarn_beta_fast", 32.0)),
                  beta_slow=float(k("rope.scaling.yarn_beta_slow", 1.0)))


def _checkpoint_dtype(tensors: list[GGUFTensorInfo]) -> str:
    """The half type of the file's matrices; quantized files report bfloat16 (the original models'
    usual dtype, and safe range-wise for dequantized compute)."""
    types = {t.ggml_type for t in tensors if len(t.dims) >= 2}
    if types <= {0}:
        return "float32"
    if types <= {0, 1}:
        return "float16"
    return "bfloat16"


# ---------------------------------------------------------------------------------------------------
# Tensor names
# ---------------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# DeepSeek's MLA projections, its plural shared experts and V3's router correction bias
_DEEPSEEK_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_STACKED_EXPERTS = re.compile(r"^ffn_(gate|up|down)_exps\.weight$")
_SPLIT_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")  # older Mixtral files, one per expert
_MIXTRAL_PART = {"gate": "w1", "down": "w2", "up": "w3"}


@dataclass(frozen=True)
class _Entry:
    """How to produce one HF tensor: which GGUF tensor, optionally one expert of it, optionally un-permuted."""

    info: GGUFTensorInfo
    expert: int | None = None
    unpermute_heads: int | None = None
    unsqueeze: bool = False
    v_b: GGUFTensorInfo | None = None
    """Set when `info` is a DeepSeek `attn_k_b` [h, R, n]: kv_b_proj is rebuilt from it and this [h, v, R]."""


class GGUFSource(WeightSource):
    """A .gguf file as a read-only, lazily dequantizing source of HF-named tensors."""

    def __init__(self, path: str):
        self.path = path
        self._mm = _map(path)
        try:
            self.metadata, self.tensors = _parse(self._mm, path, with_tensors=True)
            self.config = gguf_to_hf_config(self.metadata, self.tensors, path)
            freqs = next((t for t in self.tensors if t.name == "rope_freqs.weight"), None)
            if freqs is not None:  # per-frequency angle divisors, carried in the config (layers/rotary.py)
                self.config["rope_freqs"] = _load(self._mm, freqs, path, None).float().flatten().tolist()
            self._entries = self._build_entries()
        except ModelLoadError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise ModelLoadError(f"{path}: corrupt GGUF file ({type(e).__name__}: {e})") from None

    # -- names ------------------------------------------------------------------------------------

    def _build_entries(self) -> dict[str, _Entry]:
        cfg = self.config
        moe = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
        permuted = cfg["gguf_architecture"] in _PERMUTED_QK
        names = {**_BLOCK_NAMES, **_DEEPSEEK_NAMES} if cfg["gguf_architecture"] == "deepseek2" else _BLOCK_NAMES
        entries: dict[str, _Entry] = {}
        split_kv_b: dict[str, dict[str, GGUFTensorInfo]] = {}  # HF prefix -> {"attn_k_b": .., "attn_v_b": ..}
        self.unmapped: list[str] = []
        for t in self.tensors:
            if t.name in _GLOBAL_NAMES:
                entries[_GLOBAL_NAMES[t.name]] = _Entry(t)
                continue
            m = _BLK.match(t.name)
            if not m:
                self.unmapped.append(t.name)  # e.g. rope_freqs.weight: not an HF tensor
                continue
            layer, leaf = m[1], m[2]
            prefix = f"model.layers.{layer}."
            if leaf == "ffn_gate_inp.weight":
                entries[f"{prefix}{moe}.gate.weight"] = _Entry(t)
            elif leaf in names:
                heads = None
                if permuted and leaf == "attn_q.weight":
                    heads = cfg["num_attention_heads"]
                elif permuted and leaf == "attn_k.weight":
                    heads = cfg["num_key_value_heads"]
                # HF keeps the shared-expert gate as a [1, H] Linear weight; GGUF squeezes it to [H].
                unsqueeze = leaf == "ffn_gate_inp_shexp.weight" and len(t.dims) == 1
                entries[prefix + names[leaf]] = _Entry(t, unpermute_heads=heads, unsqueeze=unsqueeze)
            elif leaf in ("attn_k_b.weight", "attn_v_b.weight") and names is not _BLOCK_NAMES:
                split_kv_b.setdefault(prefix, {})[leaf.split(".")[0]] = t
            elif sm := _STACKED_EXPERTS.match(leaf):
                n_exp = t.shape[0]
                for e in range(n_exp):
                    entries[self._expert_name(prefix, moe, e, sm[1])] = _Entry(t, expert=e)
            elif sm := _SPLIT_EXPERT.match(leaf):
                entries[self._expert_name(prefix, moe, int(sm[2]), sm[1])] = _Entry(t)
            else:
                self.unmapped.append(t.name)
        # Newer deepseek2 files carry kv_b_proj split for llama.cpp's absorbed MLA (k_b transposed), some
        # without the whole attn_kv_b; then kv_b_proj is put back together from the two halves.
        for prefix, parts in split_kv_b.items():
            name = prefix + "self_attn.kv_b_proj.weight"
            if name in entries:
                self.unmapped += [p.name for p in parts.values()]
            elif len(parts) == 2:
                entries[name] = _Entry(parts["attn_k_b"], v_b=parts["attn_v_b"])
            else:
                raise ModelLoadError(f"{self.path}: {next(iter(parts.values())).name} has no matching "
                                     f"attn_{'v' if 'attn_k_b' in parts else 'k'}_b tensor")
        # Fail at open, not halfway through loading a model, on a storage type we cannot turn into values.
        infos = {e.info for e in entries.values()} | {e.v_b for e in entries.values() if e.v_b is not None}
        for info in sorted(infos, key=lambda t: t.offset):
            if not _readable(info.ggml_type):
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name!r} is stored as {info.type_name}, which ferrylm cannot "
                    f"dequantize (the installed gguf package has no dequantizer for it)"
                )
        return entries

    @staticmethod
    def _expert_name(prefix: str, moe: str, e: int, part: str) -> str:
        if moe == "block_sparse_moe":
            return f"{prefix}block_sparse_moe.experts.{e}.{_MIXTRAL_PART[part]}.weight"
        return f"{prefix}mlp.experts.{e}.{part}_proj.weight"

    def keys(self) -> list[str]:
        return list(self._entries)

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor an HF name comes from (diagnostics)."""
        return self._entry(name).info.name

    def ggml_type(self, name: str) -> str:
        """Storage type of the tensor behind an HF name, e.g. 'Q4_1' (diagnostics, memory planning)."""
        return self._entry(name).info.type_name

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: checkpoint has no tensor {name!r}") from None

    # -- data -------------------------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        ent = self._entry(name)
        if self._mm is None:
            raise ModelLoadError(f"{self.path}: source is closed")
        t = ent.info
        out = _load(self._mm, t, self.path, ent.expert)
        if ent.unpermute_heads:
            out = _unpermute_qk(out, ent.unpermute_heads)
        if ent.unsqueeze:
            out = out.unsqueeze(0)
        if ent.v_b is not None:  # k_b: [h, R, n], v_b: [h, v, R] -> kv_b_proj [h * (n + v), R]
            v_b = _load(self._mm, ent.v_b, self.path, None)
            out = torch.cat((out.transpose(1, 2).to(v_b.dtype), v_b), dim=1).flatten(0, 1).contiguous()
        return out

    def quantized_info(self, name: str):
        """What `get_quantized(name)` would give, without decoding its blocks: None, or its `shape` and
        `nbytes` (the repacked tensor keeps every byte of the Q4_0 / Q4_1 / Q8_0 blocks: codes, d, m)."""
        from types import SimpleNamespace

        t = self._entry(name).info
        if t.ggml_type not in _PACKED or len(t.dims) != 2 or self._entry(name).expert is not None:
            return None
        return SimpleNamespace(shape=tuple(t.shape), nbytes=t.nbytes)

    def get_quantized(self, name: str) -> QuantizedTensor | None:
        """The tensor still packed when it is a Q4_0 / Q4_1 / Q8_0 matrix (not one expert of a stacked
        tensor), else None: `get()` then gives it dense."""
        ent = self._entry(name)
        t = ent.info
        if t.ggml_type not in _PACKED or len(t.dims) != 2 or ent.expert is not None:
            return None
        if self._mm is None:
            raise ModelLoadError(f"{self.path}: source is closed")
        qt = _packed(self._mm, t)
        if ent.unpermute_heads:
            qt = QuantizedTensor(qt.scheme, qt.shape, {k: _unpermute_qk(v, ent.unpermute_heads) for k, v in
                                                        qt.parts.items()}, qt.params, qt.dtype)
        return qt

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            _unmap(mm)


def _load(buf, t: GGUFTensorInfo, path: str, expert: int | None) -> torch.Tensor:
    """One tensor (or one expert of a stacked [E, R, C] tensor) as a CPU tensor.

    F32/F16/BF16 keep their dtype; quantized blocks are dequantized to float32.
    """
    block_elems, block_bytes = _block(t.ggml_type)
    shape = t.shape  # torch order
    row_bytes = (shape[-1] if shape else 1) // block_elems * block_bytes
    lead = shape[:-1]
    offset, count = t.offset, t.nbytes
    if expert is not None:  # experts are the outermost axis: a contiguous slab each
        per = count // shape[0]
        offset, count, lead, shape = offset + expert * per, per, lead[1:], shape[1:]
    raw = np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset).reshape(*lead, row_bytes)
    qt = _Q(t.ggml_type)
    name = t.name if expert is None else f"{t.name}[expert {expert}]"
    if qt == _Q.F32:
        arr = raw.view(np.float32).copy()
    elif qt == _Q.F16:
        arr = raw.view(np.float16).copy()
    elif qt == _Q.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    elif qt in _INT_TYPES:
        arr = raw.view(_INT_TYPES[qt]).copy()
    else:
        try:
            arr = dequantize(raw, qt)
        except NotImplementedError:
            raise ModelLoadError(
                f"{path}: tensor {name!r} is stored as {qt.name}, which the installed gguf package cannot "
                f"dequantize"
            ) from None
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    return torch.from_numpy(arr).reshape(shape)


# ggml type -> (scheme, params, block bytes): the blocks ferrylm keeps packed
_PACKED = {
    _Q.Q4_0: ("int4", {"group_size": 32, "zero": "sym"}),
    _Q.Q4_1: ("int4", {"group_size": 32, "zero": "min"}),
    _Q.Q8_0: ("int8", {"group_size": 32}),
}


def _packed(buf, t: GGUFTensorInfo) -> QuantizedTensor:
    """A Q4_0 / Q4_1 / Q8_0 matrix as a group-32 `QuantizedTensor` (owned CPU memory).

    Blocks of 32 values: Q4_0 = d fp16, 16 bytes of codes; Q4_1 = d, m fp16, codes; Q8_0 = d fp16, 32 int8.
    A Q4 block keeps value j in the low nibble of byte j and value j+16 in its high nibble; the int4
    scheme packs neighbours (2i low, 2i+1 high), so the codes are re-paired here.
    """
    scheme, params = _PACKED[_Q(t.ggml_type)]
    rows, cols = t.shape
    _, block_bytes = _block(t.ggml_type)
    raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    blocks = torch.from_numpy(raw.copy()).view(rows, cols // 32, block_bytes)  # [R, G, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [R, G]
    if scheme == "int8":
        q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, cols)
        return QuantizedTensor(scheme, (rows, cols), {"q": q, "scale": d}, dict(params), torch.float32)
    parts = {"scale": d}
    if params["zero"] == "min":
        parts["min"] = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., -16:]  # [R, G, 16]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).view(rows, cols)  # [R, C]: values in order
    return QuantizedTensor(scheme, (rows, cols), {"q": pack_nibbles(codes), **parts}, dict(params), torch.float32)


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q_proj/k_proj rows.

    The converter regroups each head's rows from HF's rotate-half layout (first half, second half) into
    interleaved pairs for ggml's rope: rows [h, 2, D/2] -> [h, D/2, 2]. This reverses it.
    """
    # w: [n_head * D, C]
    rows = w.shape[0]
    d_half = rows // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
