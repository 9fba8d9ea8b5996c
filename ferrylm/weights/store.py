"""The ferry store: a converted checkpoint laid out for fast, checked, zero-copy loading.

A store is a directory:

    ferry.json            manifest (JSON, `format: ferry-store`, `version`), written last
    shard-00000.bin ...   tensor records, each at a 4 KiB-aligned offset
    tokenizer.json ...    tokenizer files, copied (or exported from a GGUF) with their checksums

Each tensor is one record: its parts (dense data, or a quantized tensor's packed codes and scales) laid
end to end at 64-byte aligned offsets, optionally zstd-compressed in independent 4 MiB chunks. Records are
written group by group - the model-wide tensors, then per layer its dense part followed by each expert - so a
(layer, expert) is one contiguous, aligned byte range a later offload engine can read in one call; the
manifest lists the groups with their ranges.

Per tensor the manifest keeps: name, dtype, shape, quantization (scheme + parameters, or null), shard file,
offset, stored bytes, raw bytes, the checksum of the stored bytes (`xxh64:<hex>`), compression, and the
parts. `StoreWriter` writes a store atomically (temporary sibling directory, fsync, manifest last, rename);
`StoreSource` reads one back: shards are memory-mapped, uncompressed tensors are views of the mapping, and
each tensor's checksum is checked the first time it is read (unless turned off, which it logs).

This module owns the on-disk format only: which tensors are quantized, and how, is `convert.py`'s business.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from ferrylm.errors import FerryError, ModelLoadError
from ferrylm.weights.quant import QuantizedTensor
from ferrylm.weights.source import WeightSource

log = logging.getLogger(__name__)

MANIFEST = "ferry.json"
FORMAT = "ferry-store"
VERSION = 1
"""Newest manifest version this code reads and the one it writes."""
ALIGN = 4096
"""Every record (and so every group) starts at a multiple of this in its shard."""
PART_ALIGN = 64
CHUNK_BYTES = 4 << 20
"""Raw bytes per independently compressed zstd chunk."""
INCOMPLETE = ".ferry-incomplete"
"""Marker present while a store is being written; a directory holding it is never loaded."""
SKIP_CHECKSUMS_ENV = "FERRY_SKIP_CHECKSUMS"

_HASHES = {"xxh64": xxhash.xxh64, "xxh3_64": xxhash.xxh3_64}
_ZERO = bytes(ALIGN)
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2")}


class StoreWriteError(FerryError):
    """A store could not be written (disk full, permissions, ...); nothing usable was left behind."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"store uses an unknown dtype {name!r}") from None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes (no copy for a contiguous CPU tensor)."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _checksum(algo: str, *pieces) -> str:
    h = _HASHES[algo]()
    for p in pieces:
        h.update(p)
    return f"{algo}:{h.hexdigest()}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir_for(dst: str) -> str:
    """The sibling directory a store is written into before it is renamed to `dst`."""
    dst = os.path.abspath(dst)
    return os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.ferry-partial")


# -- writing ---------------------------------------------------------------------------------------

class StoreWriter:
    """Writes a store into a temporary sibling of `dst`; `commit()` makes it appear at `dst` atomically.

    Any OSError becomes a `StoreWriteError` after the temporary directory is removed; `abort()` removes it
    too. A second writer for the same `dst` is refused while the first holds its lock.
    """

    def __init__(self, dst: str, *, force: bool = False, shard_bytes: int = 2 << 30, checksum: str = "xxh64",
                 compress: str | None = None, level: int = 3, threads: int | None = None):
        if checksum not in _HASHES:
            raise ValueError(f"unknown checksum {checksum!r}")
        if compress not in (None, "zstd"):
            raise ValueError(f"unknown compression {compress!r}")
        self.dst = os.path.abspath(dst)
        self.tmp = temp_dir_for(dst)
        self.force, self.shard_bytes, self.algo = force, shard_bytes, checksum
        self.compress, self.level = compress, level
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.tensors: list[dict] = []
        self.groups: list[dict] = []
        self.files: dict[str, dict] = {}
        self.shards: list[dict] = []
        self.bytes_written = 0
        self._f = None
        self._pos = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._owns_tmp = False
        self._guard("prepare", self.tmp, self._prepare)

    # -- set-up --

    def _prepare(self) -> None:
        self._check_dst()
        parent = os.path.dirname(self.dst)
        if not os.path.isdir(parent):
            raise StoreWriteError(f"{parent}: the destination's parent directory does not exist")
        if os.path.exists(self.tmp):
            self._remove_abandoned(self.tmp)
        os.mkdir(self.tmp)
        self._owns_tmp = True
        self._lock_fd = os.open(os.path.join(self.tmp, INCOMPLETE), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._lock_fd, f"ferry convert in progress, pid {os.getpid()}\n".encode())

    def _check_dst(self) -> None:
        d = self.dst
        if not os.path.exists(d):
            return
        if os.path.isdir(d) and os.path.exists(os.path.join(d, INCOMPLETE)):
            self._remove_abandoned(d)
            return
        if os.path.isdir(d) and os.path.isfile(os.path.join(d, MANIFEST)):
            if not self.force:
                raise StoreWriteError(f"{d}: a ferry store already exists there (pass --force to replace it)")
            return
        raise StoreWriteError(f"{d}: exists and is not a ferry store; refusing to overwrite it")

    def _remove_abandoned(self, path: str) -> None:
        """Remove what an interrupted convert left at `path`, unless a live convert still holds its lock."""
        marker = os.path.join(path, INCOMPLETE)
        if os.path.exists(marker):
            fd = os.open(marker, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreWriteError(f"{self.dst}: another ferry convert is writing this store right now "
                                      f"(it holds {marker})") from None
            finally:
                os.close(fd)
        elif os.listdir(path):
            raise StoreWriteError(f"{path}: exists, is not an interrupted ferry convert; remove it first")
        log.warning("%s: removing the leftovers of an interrupted convert", path)
        shutil.rmtree(path)

    def _guard(self, what: str, path: str, fn, *args):
        """Run fn; on OSError remove the temporary directory and raise a StoreWriteError naming `path`."""
        try:
            return fn(*args)
        except OSError as e:
            self.abort()
            reason = e.strerror or str(e)
            if e.errno == errno.ENOSPC:
                reason = "no space left on device"
            raise StoreWriteError(f"{self.dst}: cannot {what} {path}: {reason} [errno {e.errno}]; "
                                  f"no store was written (the partial output was removed)") from None

    # -- shards and groups --

    def begin_group(self, name: str) -> None:
        """Start a contiguous, aligned run of records (a layer's dense part, one expert, ...)."""
        self._guard("write", self._shard_path(), self._begin_group, name)

    def _begin_group(self, name: str) -> None:
        if self._f is None or self._pos >= self.shard_bytes:
            self._next_shard()
        self._pad()
        self.groups.append({"name": name, "shard": self.shards[-1]["file"], "offset": self._pos, "bytes": 0,
                            "tensors": []})

    def _shard_path(self) -> str:
        return os.path.join(self.tmp, self.shards[-1]["file"]) if self.shards else self.tmp

    def _next_shard(self) -> None:
        self._close_shard()
        fname = f"shard-{len(self.shards):05d}.bin"
        self.shards.append({"file": fname, "bytes": 0})
        self._f = open(os.path.join(self.tmp, fname), "wb", buffering=0)
        self._pos = 0

    def _close_shard(self) -> None:
        if self._f is None:
            return
        os.fsync(self._f.fileno())
        self._f.close()
        self.shards[-1]["bytes"] = self._pos
        self._f = None

    def _write(self, data) -> None:
        mv = memoryview(data)
        while len(mv):
            n = self._f.write(mv)
            mv = mv[n:]
        self._pos += len(data)
        self.bytes_written += len(data)

    def _pad(self, align: int = ALIGN) -> None:
        pad = (-self._pos) % align
        if pad:
            self._write(_ZERO[:pad])

    # -- tensors --

    def add(self, name: str, value: torch.Tensor | QuantizedTensor, extra: dict | None = None) -> dict:
        """Write one tensor (dense or quantized) into the current group; returns its manifest entry."""
        if not self.groups:
            self.begin_group("model")
        return self._guard("write", self._shard_path(), self._add, name, value, extra)

    def _add(self, name: str, value, extra) -> dict:
        if isinstance(value, QuantizedTensor):
            parts = value.parts
            quant = {"scheme": value.scheme, **value.params}
            dtype, shape = value.dtype, value.shape
        else:
            parts, quant, dtype, shape = {"data": value}, None, value.dtype, tuple(value.shape)
        views, layout, raw = [], [], 0
        for pname, t in parts.items():
            pad = (-raw) % PART_ALIGN
            if pad:
                views.append(memoryview(_ZERO[:pad]))
                raw += pad
            mv = _bytes_of(t)
            layout.append({"name": pname, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": raw,
                           "bytes": len(mv)})
            views.append(mv)
            raw += len(mv)
        compression, stored = None, views
        if self.compress and raw >= PART_ALIGN:
            chunks = self._compress(views, raw)
            if sum(len(c) for c in chunks) < 0.97 * raw:  # keep incompressible data zero-copy
                compression = {"codec": "zstd", "level": self.level, "chunk_bytes": CHUNK_BYTES,
                               "chunks": [len(c) for c in chunks]}
                stored = chunks
        self._pad()
        offset = self._pos
        checksum = _checksum(self.algo, *stored)
        for piece in stored:
            self._write(piece)
        entry = {"name": name, "dtype": dtype_name(dtype), "shape": list(shape), "quant": quant,
                 "shard": self.shards[-1]["file"], "offset": offset, "stored_bytes": self._pos - offset,
                 "raw_bytes": raw, "checksum": checksum, "compression": compression, "parts": layout,
                 "group": self.groups[-1]["name"]}
        if extra:
            entry.update(extra)
        g = self.groups[-1]
        g["bytes"] = self._pos - g["offset"]
        g["tensors"].append(name)
        self.tensors.append(entry)
        return entry

    def _compress(self, views: list[memoryview], raw: int) -> list[bytes]:
        import zstandard

        buf = bytearray(raw) if len(views) > 1 else None
        if buf is not None:
            pos = 0
            for v in views:
                buf[pos:pos + len(v)] = v
                pos += len(v)
        data = memoryview(buf) if buf is not None else views[0]
        spans = [data[i:i + CHUNK_BYTES] for i in range(0, raw, CHUNK_BYTES)]
        local = threading.local()

        def one(span):  # a ZstdCompressor is not thread-safe: one per thread
            if not hasattr(local, "c"):
                local.c = zstandard.ZstdCompressor(level=self.level)
            return local.c.compress(span)

        if len(spans) == 1:
            return [one(spans[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads)
        return list(self._pool.map(one, spans))

    def add_file(self, name: str, data: bytes) -> None:
        """A small side file (tokenizer.json, ...) stored beside the shards, listed with its checksum."""
        self._guard("write", os.path.join(self.tmp, name), self._add_file, name, data)

    def _add_file(self, name: str, data: bytes) -> None:
        if os.path.basename(name) != name or name in (MANIFEST, INCOMPLETE) or name.startswith("shard-"):
            raise ValueError(f"bad side-file name {name!r}")
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"bytes": len(data), "checksum": _checksum(self.algo, data)}
        self.bytes_written += len(data)

    # -- finishing --

    def commit(self, config: dict, meta: dict | None = None) -> dict:
        """fsync everything, write the manifest last, rename into place. Returns the manifest."""
        return self._guard("finish", self.tmp, self._commit, config, meta or {})

    def _commit(self, config: dict, meta: dict) -> dict:
        self._close_shard()
        if self._pool is not None:
            self._pool.shutdown()
        manifest = {"format": FORMAT, "version": VERSION, **meta, "config": config, "checksum": self.algo,
                    "alignment": ALIGN, "shards": self.shards, "files": self.files, "groups": self.groups,
                    "tensors": self.tensors}
        manifest["manifest_checksum"] = manifest_checksum(manifest)
        path = os.path.join(self.tmp, MANIFEST)
        with open(path, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        self._check_dst()  # something may have appeared at dst while we converted
        old = None
        if os.path.exists(self.dst):  # --force over a complete store: swap, then drop the old one
            old = self.dst + f".ferry-old-{os.getpid()}"
            os.rename(self.dst, old)
        try:
            os.rename(self.tmp, self.dst)
        except OSError:
            if old:  # put the previous store back: a failed convert never costs the user a store
                os.rename(old, self.dst)
            raise
        self._owns_tmp = False
        _fsync_dir(os.path.dirname(self.dst))
        os.unlink(os.path.join(self.dst, INCOMPLETE))  # from here on the store loads
        _fsync_dir(self.dst)
        os.close(self._lock_fd)
        self._lock_fd = None
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def abort(self) -> None:
        """Remove everything written so far (safe to call twice)."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
        if self._owns_tmp and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._owns_tmp = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# -- reading ---------------------------------------------------------------------------------------

def read_manifest(path: str) -> dict:
    """Parse and check `path/ferry.json`; every problem is a ModelLoadError that says what to do."""
    if os.path.exists(os.path.join(path, INCOMPLETE)):
        raise ModelLoadError(f"{path}: incomplete ferry store (a convert was interrupted or is still running); "
                             f"run `ferry convert` again to finish it")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not a ferry store (no {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{mpath}: unreadable or corrupt store manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{mpath}: not a ferry store manifest (format is not {FORMAT!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        raise ModelLoadError(f"{mpath}: store manifest has no valid version ({version!r})")
    if version > VERSION:
        raise ModelLoadError(f"{mpath}: store format version {version} was written by a newer ferrylm; this "
                             f"ferrylm reads up to version {VERSION}: upgrade ferrylm or convert the model again")
    for key in ("config", "shards", "tensors"):
        if key not in manifest:
            raise ModelLoadError(f"{mpath}: store manifest lacks {key!r}")
    algo = manifest.get("checksum", "xxh64")
    if algo not in _HASHES:
        raise ModelLoadError(f"{mpath}: store uses an unknown checksum {algo!r}")
    # the records' own checksums cover the tensor bytes; this one covers shapes, offsets and parameters
    if "manifest_checksum" in manifest and manifest["manifest_checksum"] != manifest_checksum(manifest):
        raise ModelLoadError(f"{mpath}: the store manifest is corrupt (its checksum does not match); "
                             f"convert the model again")
    return manifest


def manifest_checksum(manifest: dict) -> str:
    """xxh64 of the manifest's canonical JSON, without the checksum field itself."""
    body = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    return "xxh64:" + xxhash.xxh64(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _skip_from_env() -> bool:
    return os.environ.get(SKIP_CHECKSUMS_ENV, "").strip().lower() in ("1", "true", "yes")


class StoreSource(WeightSource):
    """Reads a ferry store. Checksums are checked on each tensor's first read unless `verify_checksums`
    is False (or FERRY_SKIP_CHECKSUMS=1), which is logged as a warning."""

    def __init__(self, path: str, verify_checksums: bool | None = None, threads: int | None = None):
        self.path = path
        self.manifest = read_manifest(path)
        self.config = self.manifest["config"]
        self.algo = self.manifest.get("checksum", "xxh64")
        self.verify_checksums = (not _skip_from_env()) if verify_checksums is None else verify_checksums
        if not self.verify_checksums:
            log.warning("%s: ferry store checksums are NOT being checked (verify_checksums=False or %s=1)",
                        path, SKIP_CHECKSUMS_ENV)
        self._entries = {e["name"]: e for e in self.manifest["tensors"]}
        self._shard_size = {s["file"]: s["bytes"] for s in self.manifest["shards"]}
        for fname, size in self._shard_size.items():
            self._check_shard(fname, size)
        for fname, info in self.manifest.get("files", {}).items():
            self._check_file(fname, info)
        self._maps: dict[str, mmap.mmap] = {}
        self._verified: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.threads = threads or min(8, os.cpu_count() or 1)

    @property
    def groups(self) -> list[dict]:
        """Contiguous aligned byte ranges: name (`model`, `layers.L.dense`, `layers.L.experts.E`), shard,
        offset, bytes, tensors."""
        return self.manifest.get("groups", [])

    def _check_shard(self, fname: str, size: int) -> None:
        fpath = os.path.join(self.path, fname)
        try:
            actual = os.path.getsize(fpath)
        except FileNotFoundError:
            raise ModelLoadError(f"{fpath}: shard file is missing from the store; convert the model again") from None
        except OSError as e:
            raise ModelLoadError(f"{fpath}: cannot read shard file ({e.strerror})") from None
        if actual < size:
            raise ModelLoadError(f"{fpath}: shard file is truncated ({actual} bytes, the manifest says {size}); "
                                 f"convert the model again")

    def _check_file(self, fname: str, info: dict) -> None:
        fpath = os.path.join(self.path, fname)
        try:
            with open(fpath, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ModelLoadError(f"{fpath}: store file missing or unreadable ({e.strerror})") from None
        if self.verify_checksums and _checksum(self.algo, data) != info["checksum"]:
            raise ModelLoadError(f"{fpath}: checksum mismatch (the file is corrupt); convert the model again")

    def keys(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: store has no tensor {name!r}") from None

    def _map(self, fname: str) -> mmap.mmap:
        mm = self._maps.get(fname)
        if mm is None:
            fpath = os.path.join(self.path, fname)
            try:
                with open(fpath, "rb") as f:
                    # private copy-on-write mapping: tensors over it are writable, nothing is copied up front
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{fpath}: cannot map shard file ({e})") from None
            self._maps[fname] = mm
        return mm

    def _stored(self, e: dict) -> tuple[object, int]:
        """The record's raw bytes as (buffer, offset), checksum-checked on first use."""
        fname = e["shard"]
        off, n = e["offset"], e["stored_bytes"]
        if off + n > self._shard_size.get(fname, -1):
            raise ModelLoadError(f"{self.path}/{fname}: tensor {e['name']!r} lies outside its shard "
                                 f"(bytes {off}..{off + n}); the manifest is corrupt")
        mm = self._map(fname)
        if self.verify_checksums and e["name"] not in self._verified:
            self._verify(e, mm)
            self._verified.add(e["name"])
        c = e.get("compression")
        if not c:
            return mm, off
        return self._decompress(e, mm), 0

    def _verify(self, e: dict, mm: mmap.mmap) -> None:
        off, n = e["offset"], e["stored_bytes"]
        if n >= ALIGN:
            try:
                mm.madvise(mmap.MADV_WILLNEED, off - off % mmap.PAGESIZE, n + off % mmap.PAGESIZE)
            except (OSError, ValueError, AttributeError):
                pass
        with memoryview(mm) as mv:
            got = _checksum(self.algo, mv[off:off + n])
        if got != e["checksum"]:
            raise ModelLoadError(
                f"{os.path.join(self.path, e['shard'])}: checksum mismatch in tensor {e['name']!r} at bytes "
                f"{off}..{off + n} (expected {e['checksum']}, found {got}): the store is corrupt; "
                f"convert the model again")

    def _decompress(self, e: dict, mm: mmap.mmap) -> bytearray:
        import zstandard

        c = e["compression"]
        if c.get("codec") != "zstd":
            raise ModelLoadError(f"{self.path}: tensor {e['name']!r} uses unknown compression {c.get('codec')!r}")
        raw, step = e["raw_bytes"], c["chunk_bytes"]
        out = bytearray(raw)
        jobs, src = [], e["offset"]
        for i, clen in enumerate(c["chunks"]):
            jobs.append((src, clen, i * step, min(step, raw - i * step)))
            src += clen

        def one(job):
            s, clen, d, dlen = job
            try:
                data = zstandard.ZstdDecompressor().decompress(mm[s:s + clen], max_output_size=dlen)
            except zstandard.ZstdError as err:
                raise ModelLoadError(f"{os.path.join(self.path, e['shard'])}: tensor {e['name']!r}: corrupt zstd "
                                     f"chunk at bytes {s}..{s + clen} ({err})") from None
            if len(data) != dlen:
                raise ModelLoadError(f"{os.path.join(self.path, e['shard'])}: tensor {e['name']!r}: zstd chunk at "
                                     f"bytes {s}..{s + clen} gave {len(data)} bytes, expected {dlen}")
            out[d:d + dlen] = data

        if len(jobs) == 1:
            one(jobs[0])
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads)
            list(self._pool.map(one, jobs))
        return out

    def _parts(self, e: dict) -> dict[str, torch.Tensor]:
        buf, base = self._stored(e)
        parts = {}
        for p in e["parts"]:
            dt = parse_dtype(p["dtype"])
            numel = 1
            for d in p["shape"]:
                numel *= d
            if numel == 0:
                parts[p["name"]] = torch.empty(p["shape"], dtype=dt)
                continue
            t = torch.frombuffer(buf, dtype=dt, count=numel, offset=base + p["offset"])  # zero-copy view
            parts[p["name"]] = t.view(p["shape"])
        return parts

    def _quantized(self, e: dict) -> QuantizedTensor:
        q = dict(e["quant"])
        scheme = q.pop("scheme")
        return QuantizedTensor(scheme, tuple(e["shape"]), self._parts(e), q, parse_dtype(e["dtype"]))

    def get(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        if e.get("quant"):
            return self._quantized(e).dequantize()
        return self._parts(e)["data"]

    def get_quantized(self, name: str) -> QuantizedTensor | None:
        """The packed tensor (parts are views of the shard), or None when `name` is stored unquantized."""
        e = self.entry(name)
        return self._quantized(e) if e.get("quant") else None

    def verify(self, progress=None) -> list[str]:
        """Check every tensor's checksum (and that compressed chunks decompress); returns the problems."""
        problems = []
        for name, e in self._entries.items():
            try:
                mm = self._map(e["shard"])
                if e["offset"] + e["stored_bytes"] > self._shard_size.get(e["shard"], -1):
                    raise ModelLoadError(f"{self.path}: tensor {name!r} lies outside its shard")
                self._verify(e, mm)
                if e.get("compression"):
                    self._decompress(e, mm)
            except ModelLoadError as err:
                problems.append(str(err))
            if progress:
                progress(name, e["stored_bytes"])
        return problems

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # tensors still view it: the mapping goes when they do
                pass
        self._maps.clear()
