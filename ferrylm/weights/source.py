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


class SafetensorsSource(WeightSource):
    """An HF model directory: config.json plus one or more *.safetensors (sharded or not)."""

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

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        try:
            fname = self._where[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: checkpoint has no tensor {name!r}") from None
        return self._handles[fname].get_tensor(name)

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """`get(name).narrow(dim, start, length)`, reading only those bytes (a tensor-parallel rank's slice)."""
        if name not in self._where:
            return self.get(name)  # raises the missing-tensor error
        sl = self._handles[self._where[name]].get_slice(name)
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, start + length)
        return sl[tuple(index)]

    def close(self) -> None:
        self._handles.clear()


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
