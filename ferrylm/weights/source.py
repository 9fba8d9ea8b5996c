"""Weight sources: read-only access to a checkpoint's tensors under their HF names.

A source knows files and formats (safetensors directory, GGUF file, ferry store); it knows nothing about
models or devices. `open_source(path)` picks the implementation from what the path holds.
"""

from __future__ import annotations

import json
import os
import struct
from abc import ABC, abstractmethod

import torch

from ferrylm.errors import ModelLoadError


class WeightSource(ABC):
    """Read-only access to a checkpoint's tensors under their HF names."""

    config: dict
    """HF config.json-style dict."""
    path: str

    @abstractmethod
    def keys(self) -> list[str]:
        """HF tensor names."""

    @abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """One tensor on the CPU (its stored dtype; quantized formats come back dequantized)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FP8_SCALE_SUFFIX = ".weight_scale_inv"


class SafetensorsSource(WeightSource):
    """An HF model directory: config.json plus one or more *.safetensors (sharded or not).

    A checkpoint whose `quantization_config` says block-wise FP8 (`quant_method` "fp8" with `weight_block_size`,
    as DeepSeek-V3 and the Qwen3 FP8 releases ship: e4m3 `weight` plus a `weight_scale_inv` per block, fp32 in
    DeepSeek's, bf16 in Qwen3's) hands
    its FP8 weights out packed (`get_quantized`: group-wise `fp8`, exactly the same values) and dense in the
    model dtype through `get`; the scale tensors are not names of their own. Activations stay in the model
    dtype (weight-only, as on GPUs without FP8 tensor cores): the reference's dynamic per-token FP8 activations
    are not emulated. Any other `quant_method` is refused by name."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"{path}: no config.json in the model directory")
        try:
            with open(cfg_path) as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{cfg_path}: cannot read config.json ({e})") from None
        files = _weight_files(path)
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files in the model directory")
        self._handles = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise ModelLoadError(f"{fpath}: shard named in the index is missing")
            _check_safetensors_size(fpath)
            try:
                h = safe_open(fpath, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{fpath}: not a readable safetensors file ({e})") from None
            self._handles[fname] = h
            for k in h.keys():
                self._where[k] = fname
        self.fp8_block = fp8_block(path, self.config)
        self._scales = {}  # FP8 weight name -> its weight_scale_inv's name
        if self.fp8_block:
            for k in self._where:
                if k.endswith(FP8_SCALE_SUFFIX):
                    self._scales[k[: -len(FP8_SCALE_SUFFIX)] + ".weight"] = k

    def keys(self) -> list[str]:
        return [k for k in self._where if not k.endswith(FP8_SCALE_SUFFIX)] if self._scales else list(self._where)

    def _raw(self, name: str) -> torch.Tensor:
        try:
            fname = self._where[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: checkpoint has no tensor {name!r}") from None
        return self._handles[fname].get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._scales:
            from ferrylm.weights.quant import fp8_block_dequantize

            return fp8_block_dequantize(*self._fp8(name), self.fp8_block, self.dtype)
        t = self._raw(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # its values mean nothing without their scales
            raise ModelLoadError(f"{self.path}: {name!r} is {t.dtype} but the checkpoint has no "
                                 f"{name.removesuffix('.weight')}{FP8_SCALE_SUFFIX} for it")
        return t

    def get_quantized(self, name: str):
        """A block-wise FP8 weight as a group-wise `fp8` QuantizedTensor (None for every other tensor, and for
        an FP8 weight whose rows are no multiple of the block: `get` dequantizes that one)."""
        if name not in self._scales:
            return None
        from ferrylm.weights.quant import from_fp8_blocks

        return from_fp8_blocks(*self._fp8(name), self.fp8_block, self.dtype)

    def quantized_info(self, name: str):
        """What `get_quantized(name)` would give, from the headers alone (no tensor read): None, or its `shape`
        and `nbytes` (codes plus an fp32 scale per row and block of K)."""
        if name not in self._scales:
            return None
        from types import SimpleNamespace

        from ferrylm.weights.quant import fp8_blocks_nbytes

        shape = tuple(self._handles[self._where[name]].get_slice(name).get_shape())
        nbytes = fp8_blocks_nbytes(shape, self.fp8_block[1])
        return None if nbytes is None else SimpleNamespace(shape=shape, nbytes=nbytes)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype FP8 weights dequantize to: config.json's `torch_dtype` (bf16 where it names none)."""
        name = self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16"
        dt = getattr(torch, str(name), None)
        return dt if isinstance(dt, torch.dtype) and dt.is_floating_point and dt.itemsize >= 2 else torch.bfloat16

    def _fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = self._raw(name), self._raw(self._scales[name])
        bn, bk = self.fp8_block
        want = (-(-w.shape[0] // bn), -(-w.shape[1] // bk)) if w.dim() == 2 else "?"
        if w.dtype != torch.float8_e4m3fn or s.shape != want:
            raise ModelLoadError(f"{self.path}: {name!r} is {w.dtype} {tuple(w.shape)} with scales {tuple(s.shape)}: "
                                 f"not block-wise FP8 e4m3 in blocks of {bn} x {bk} (scales {want} expected)")
        return w, s

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """`get(name).narrow(dim, start, length)`, reading only those bytes (a tensor-parallel rank's slice)."""
        if name not in self._where or name in self._scales:
            return self.get(name).narrow(dim, start, length)  # (or the missing-tensor error)
        sl = self._handles[self._where[name]].get_slice(name)
        if sl.get_dtype().startswith("F8"):
            return self.get(name)  # an FP8 weight without scales: the error that names it
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, start + length)
        return sl[tuple(index)]

    def close(self) -> None:
        self._handles.clear()


def fp8_block(path: str, config: dict) -> tuple[int, int] | None:
    """The FP8 block shape a checkpoint's `quantization_config` declares, None where it declares none; any other
    quantization method (GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) is refused by name."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise ModelLoadError(f"{path}: quantization_config.quant_method {method!r} checkpoints are not supported "
                             "(block-wise 'fp8' is); load the unquantized checkpoint, or convert the unquantized "
                             "checkpoint with `ferry convert --quant` for a packed store")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{path}: fp8 quantization_config without a weight_block_size of two positive "
                             f"integers ({block!r}): only block-wise FP8 checkpoints are supported")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{path}: fp8 activation_scheme {qc.get('activation_scheme')!r}: only 'dynamic' "
                             "checkpoints (no input scales) are supported")
    return int(block[0]), int(block[1])


def _weight_files(path: str) -> list[str]:
    """The checkpoint's shards: the index's files, else `model*.safetensors`, else every *.safetensors
    (so other safetensors files kept beside a model, e.g. reference outputs, are not taken for weights)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [f for f in files if f.startswith("model")] or files


def _check_safetensors_size(fpath: str) -> None:
    """A truncated safetensors file would otherwise fail later with an obscure mmap error."""
    size = os.path.getsize(fpath)
    try:
        with open(fpath, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, OSError) as e:
        raise ModelLoadError(f"{fpath}: corrupt or truncated safetensors header ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ModelLoadError(
            f"{fpath}: truncated safetensors file ({size} bytes, header promises {8 + header_len + end})"
        )


def open_source(path: "str | WeightSource | None") -> WeightSource:
    """Open whatever `path` holds; None means the embedded default model; a source is used as it is."""
    if isinstance(path, WeightSource):
        return path
    if path is None:
        from ferrylm.default_model import default_model_path

        path = default_model_path()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from ferrylm.weights.gguf import GGUFSource

            return GGUFSource(path)
        raise ModelLoadError(f"{path}: a model file must be .gguf (or pass an HF model directory)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelLoadError(f"{path}: directory is not readable")
    if os.path.isfile(os.path.join(path, "ferry.json")):
        from ferrylm.weights.store import StoreSource

        return StoreSource(path)
    ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
    if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
        from ferrylm.weights.gguf import GGUFSource

        return GGUFSource(os.path.join(path, ggufs[0]))
    return SafetensorsSource(path)
