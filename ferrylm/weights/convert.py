"""`ferry convert`: turn an HF directory or a GGUF file into a ferry store (see `store.py` for the format),
optionally quantized (INT8 / NF4 / FP8, `quant.py`) and zstd-compressed; `ferry convert --verify DST`
re-checks every checksum of a store.

This module decides *what* is stored how: which tensors are quantized (2-D projection weights; router
gates, norms, embeddings and the LM head stay in high precision, plus whatever --keep-high-precision
matches), the group order on disk, the tokenizer files to carry, and the report. It knows nothing about
models: it reads tensors by name from a `WeightSource`.

Run as `ferry convert ...` or `python -m ferrylm.weights.convert ...`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

import torch

from ferrylm.errors import FerryError, ModelLoadError
from ferrylm.weights import quant as Q
from ferrylm.weights.store import StoreSource, StoreWriter

log = logging.getLogger(__name__)

QUANT_CHOICES = ("none",) + Q.SCHEMES + ("q8_0",)
"""`q8_0`: group-wise int8, one fp16 scale per 32 values of a row (llama.cpp's Q8_0; the CPU kernel's layout)."""
Q8_0_GROUP = 32
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Names that stay in high precision whatever --quant says (fnmatch patterns on HF tensor names).
HIGH_PRECISION = (
    "*embed_tokens*", "*wte.*", "*word_embeddings*", "lm_head.*",  # embeddings and the LM head
    "*norm*",  # all norms
    "*.gate.*", "*shared_expert_gate*", "*router*",  # MoE routers (`.gate.`, not gate_proj)
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass
class ConvertOptions:
    quant: str = "none"
    """none | int8 | nf4 | fp8 | int4 | q8_0. With none, a source's packed blocks (GGUF Q4_0 / Q4_1 / Q8_0)
    are kept as they are (lossless, unless `dequantize`); any other choice re-quantizes from the dequantized
    values."""
    group_size: int = 64
    """NF4 values per absmax (64 or 128); int4 values per scale (32, 64, 128 or 256)."""
    double_quant: bool = False
    """NF4: store the per-group absmaxes as int8 (QLoRA double quantization)."""
    dequantize: bool = False
    """With quant none: write a source's packed blocks as dense values (e.g. a bf16 store of a GGUF)."""
    keep_high_precision: tuple[str, ...] = ()
    """Extra fnmatch patterns of tensor names never quantized."""
    compress: str | None = None
    """None or 'zstd'."""
    level: int = 3
    """zstd level."""
    dtype: str | None = None
    """High-precision dtype of the store (bfloat16 | float16); None keeps each tensor's source dtype."""
    shard_bytes: int = 2 << 30
    """Target shard size; a group never spans two shards."""
    force: bool = False
    """Replace an existing store at DST."""


@dataclass
class ConvertReport:
    src: str
    dst: str
    tensors: int = 0
    quantized: int = 0
    packed: int = 0
    """Tensors kept in the source's own packed blocks (lossless)."""
    bytes_before: int = 0
    """Source tensor bytes as read (GGUF tensors count dequantized)."""
    bytes_source_files: int = 0
    """The source's weight files on disk (a GGUF's quantized bytes)."""
    bytes_raw: int = 0
    """Record bytes before compression."""
    bytes_stored: int = 0
    """Record bytes on disk (after compression, before alignment padding)."""
    bytes_files: int = 0
    """Shard files + side files on disk, padding included."""
    seconds: float = 0.0
    errors: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    """scheme -> [(tensor, relative error ||w - dq(w)|| / ||w||)]."""


def high_precision(name: str, patterns: tuple[str, ...] = ()) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in HIGH_PRECISION + tuple(patterns))


def scheme_for(name: str, t: torch.Tensor, opts: ConvertOptions) -> str | None:
    if opts.quant == "none" or t.dim() < 2 or not t.is_floating_point():
        return None
    return None if high_precision(name, opts.keep_high_precision) else opts.quant


def stored_scheme(name: str, t: torch.Tensor, opts: ConvertOptions) -> str | None:
    """The scheme `convert` stores `name` in (None: high precision). Also what `ferry plan` counts (on meta)."""
    scheme = scheme_for(name, t, opts)
    group = Q8_0_GROUP if scheme == "q8_0" else opts.group_size
    if scheme in ("int4", "q8_0") and (t.dim() != 2 or t.shape[1] % group):
        return None  # int4 / q8_0 are group-wise along rows: such a tensor stays in high precision
    return scheme


def quantize_stored(t: torch.Tensor, scheme: str, opts: ConvertOptions) -> Q.QuantizedTensor:
    return Q.quantize_int8(t, Q8_0_GROUP) if scheme == "q8_0" else Q.quantize(t, scheme, opts.group_size,
                                                                             opts.double_quant)


def group_of(name: str) -> tuple[tuple, str]:
    """(sort key, group name): model-wide tensors, then per layer its dense part and each expert."""
    m = _LAYER.search(name)
    if not m:
        return (0, 0, 0, 0), "model"
    layer = int(m[1])
    e = _EXPERT.search(name, m.end() - 1)
    if e:
        return (1, layer, 1, int(e[1])), f"layers.{layer}.experts.{e[1]}"
    return (1, layer, 0, 0), f"layers.{layer}.dense"


def ordered_groups(names: list[str]) -> list[tuple[str, list[str]]]:
    groups: dict[str, tuple[tuple, list[str]]] = {}
    for n in names:
        key, g = group_of(n)
        groups.setdefault(g, (key, []))[1].append(n)
    return [(g, ns) for g, (_, ns) in sorted(groups.items(), key=lambda kv: kv[1][0])]


def relative_error(w: torch.Tensor, qt: Q.QuantizedTensor) -> float:
    w = w.float()
    norm = w.norm().item()
    return (w - qt.dequantize(torch.float32)).norm().item() / norm if norm > 0 else 0.0


# -- tokenizer -------------------------------------------------------------------------------------

def tokenizer_files(src: str, source) -> dict[str, bytes]:
    """Tokenizer files to carry: copied from an HF directory (or a store), exported from a GGUF."""
    if type(source).__name__ == "GGUFSource":
        return export_gguf_tokenizer(source.path)
    folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    out = {}
    for f in TOKENIZER_FILES:
        p = os.path.join(folder, f)
        if os.path.isfile(p):
            with open(p, "rb") as fh:
                out[f] = fh.read()
    return out


def export_gguf_tokenizer(gguf_path: str) -> dict[str, bytes]:
    """The tokenizer a GGUF embeds, as HF files: tokenizer.json (the `tokenizers` object ferrylm builds from
    the GGUF vocabulary), tokenizer_config.json (chat template(s), special tokens, add_bos_token) and
    generation_config.json (every EOS id), so `Tokenizer.load(store)` behaves as `Tokenizer.load(gguf)`."""
    import json

    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(gguf_path)
    cfg: dict = {k: v for k, v in tok.special_tokens.items()}
    cfg["add_bos_token"] = bool(tok.add_bos)
    cfg["add_eos_token"] = bool(tok.add_eos)
    templates = dict(tok.chat_templates)
    if templates:
        cfg["chat_template"] = (templates["default"] if list(templates) == ["default"] else
                                [{"name": k, "template": v} for k, v in templates.items()])
    gen = {"bos_token_id": tok.bos_token_id,
           "eos_token_id": [tok.eos_token_id] + sorted(i for i in tok.eos_token_ids if i != tok.eos_token_id)
           if tok.eos_token_id is not None else sorted(tok.eos_token_ids)}
    return {"tokenizer.json": tok.backend.to_str().encode(),
            "tokenizer_config.json": json.dumps(cfg, indent=1, ensure_ascii=False).encode(),
            "generation_config.json": json.dumps(gen, indent=1).encode()}


# -- convert ---------------------------------------------------------------------------------------

def convert(src: str, dst: str, opts: ConvertOptions | None = None, progress: bool = False) -> ConvertReport:
    """Write the ferry store of `src` at `dst`. Nothing appears at `dst` unless every byte made it to disk."""
    from ferrylm.weights.source import open_source

    opts = opts or ConvertOptions()
    if opts.quant not in QUANT_CHOICES:
        raise FerryError(f"unknown --quant {opts.quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
    if opts.quant == "nf4" and opts.group_size not in Q.GROUP_SIZES:
        raise FerryError(f"--group-size must be one of {Q.GROUP_SIZES}, not {opts.group_size}")
    if opts.quant == "int4" and opts.group_size not in Q.INT4_GROUP_SIZES:
        raise FerryError(f"--group-size must be one of {Q.INT4_GROUP_SIZES} for int4, not {opts.group_size}")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise FerryError(f"unknown --dtype {opts.dtype!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise FerryError("SRC and DST are the same path")
    report = ConvertReport(src, dst, bytes_source_files=_weight_file_bytes(src))
    t0 = time.perf_counter()
    source = open_source(src)
    try:
        writer = StoreWriter(dst, force=opts.force, shard_bytes=opts.shard_bytes, compress=opts.compress,
                             level=opts.level)
        try:
            groups = ordered_groups(source.keys())
            files = tokenizer_files(src, source)
            # the tokenizer reads config.json too (architecture-specific special tokens, bos fallback)
            cfg_file = os.path.join(src, "config.json")
            config = source.config
            if "quantization_config" in config:  # (block-wise FP8: the store's own manifest says how each is kept)
                config = {k: v for k, v in config.items() if k != "quantization_config"}
                files["config.json"] = json.dumps(config, indent=1).encode()
            if os.path.isfile(cfg_file):
                with open(cfg_file, "rb") as f:
                    files.setdefault("config.json", f.read())
            files.setdefault("config.json", json.dumps(config, indent=1).encode())
            if not any(f in files for f in ("tokenizer.json", "tokenizer.model")):
                log.warning("%s: no tokenizer files found; the store will need --tokenizer", src)
            with _Progress(progress, sum(len(ns) for _, ns in groups)) as bar:
                for gname, names in groups:
                    writer.begin_group(gname)
                    keep = opts.quant == "none" and not opts.dequantize
                    packed = getattr(source, "get_quantized", None) if keep else None
                    for name in names:
                        qt = packed(name) if packed else None
                        if qt is not None:  # the source's blocks as they are
                            _keep_packed(name, qt, writer, opts, report,
                                         "fp8-blocks" if getattr(source, "fp8_block", None) else "gguf")
                        else:
                            _convert_one(name, source.get(name), writer, opts, report)
                        bar.advance(report)
            for fname, data in files.items():
                writer.add_file(fname, data)
            meta = {"created_by": _created_by(), "source": {"path": os.path.abspath(src),
                                                            "kind": type(source).__name__},
                    "quantization": {"scheme": opts.quant, "group_size": opts.group_size,
                                     "double_quant": opts.double_quant,
                                     "keep_high_precision": list(HIGH_PRECISION + tuple(opts.keep_high_precision))}}
            manifest = writer.commit(config, meta)
        except BaseException:
            writer.abort()  # KeyboardInterrupt and bugs too: never leave a temporary store behind
            raise
    finally:
        source.close()
    report.bytes_files = sum(s["bytes"] for s in manifest["shards"]) + sum(f["bytes"] for f in manifest["files"].values())
    report.seconds = time.perf_counter() - t0
    return report


def _keep_packed(name: str, qt: Q.QuantizedTensor, writer: StoreWriter, opts: ConvertOptions,
                 report: ConvertReport, origin: str) -> None:
    report.tensors += 1
    report.packed += 1
    report.bytes_before += qt.shape[0] * qt.shape[1] * 4  # as read dequantized
    if opts.dtype:
        qt.dtype = DTYPES[opts.dtype]
    e = writer.add(name, qt, {"packed_from": origin})
    report.bytes_raw += e["raw_bytes"]
    report.bytes_stored += e["stored_bytes"]


def _convert_one(name: str, t: torch.Tensor, writer: StoreWriter, opts: ConvertOptions, report: ConvertReport) -> None:
    report.tensors += 1
    report.bytes_before += t.numel() * t.element_size()
    target = DTYPES[opts.dtype] if opts.dtype and t.is_floating_point() else t.dtype
    scheme = stored_scheme(name, t, opts)
    if scheme is None:
        value, extra = t.to(target), None
    else:
        value = quantize_stored(t, scheme, opts)
        value.dtype = target
        err = relative_error(t, value)
        report.errors.setdefault(scheme, []).append((name, err))
        report.quantized += 1
        extra = {"rel_error": round(err, 6)}
    e = writer.add(name, value, extra)
    report.bytes_raw += e["raw_bytes"]
    report.bytes_stored += e["stored_bytes"]


def _weight_file_bytes(src: str) -> int:
    if os.path.isfile(src):
        return os.path.getsize(src)
    if not os.path.isdir(src):
        return 0
    return sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)
               if f.endswith((".safetensors", ".gguf")) or (f.startswith("shard-") and f.endswith(".bin")))


def _created_by() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"ferrylm {version('ferrylm')}"
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "ferrylm (not installed)"


class _Progress:
    """A rich progress bar over tensors that also shows bytes read and written (no-op when disabled)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("converting"), BarColumn(), TextColumn("{task.completed}/{task.total} tensors"),
                                TextColumn("read {task.fields[read]}, wrote {task.fields[wrote]}"),
                                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), transient=True)
            self.task = self.bar.add_task("convert", total=self.total, read="0 B", wrote="0 B", rate="")
            self.t0 = time.perf_counter()
            self.bar.start()
        return self

    def advance(self, r: ConvertReport) -> None:
        if self.enabled:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, advance=1, read=_fmt_bytes(r.bytes_before), wrote=_fmt_bytes(r.bytes_stored),
                            rate=f"{_fmt_bytes(r.bytes_before / dt)}/s")

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def print_report(r: ConvertReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"ferry convert {r.src} -> {r.dst}", show_header=False)
    t.add_row("tensors", f"{r.tensors} ({r.quantized} quantized, {r.packed} kept in the source's packed blocks)")
    t.add_row("bytes before", f"{r.bytes_before:,} ({_fmt_bytes(r.bytes_before)} of tensors as read)")
    if r.bytes_source_files and r.bytes_source_files != r.bytes_before:
        t.add_row("source files", f"{r.bytes_source_files:,} ({_fmt_bytes(r.bytes_source_files)} on disk)")
    t.add_row("bytes after", f"{r.bytes_files:,} ({_fmt_bytes(r.bytes_files)}, padding and tokenizer included)")
    t.add_row("size ratio before/after", f"{r.bytes_before / max(r.bytes_files, 1):.3f}x")
    if r.bytes_raw != r.bytes_stored:
        t.add_row("zstd ratio (raw/stored)", f"{r.bytes_raw / max(r.bytes_stored, 1):.3f}x")
    t.add_row("time", f"{r.seconds:.1f} s ({_fmt_bytes(r.bytes_before / max(r.seconds, 1e-9))}/s read)")
    console.print(t)
    if r.errors:
        e = Table(title="quantization error per tensor: ||w - dequant(w)|| / ||w||")
        for col in ("scheme", "tensors", "mean", "worst", "worst tensor"):
            e.add_column(col)
        for scheme, errs in r.errors.items():
            worst = max(errs, key=lambda x: x[1])
            e.add_row(scheme, str(len(errs)), f"{sum(x for _, x in errs) / len(errs):.4f}", f"{worst[1]:.4f}", worst[0])
        console.print(e)


# -- verify ----------------------------------------------------------------------------------------

def verify(path: str, progress: bool = False) -> list[str]:
    """Every problem found in the store at `path` (empty when all checksums match)."""
    src = StoreSource(path, verify_checksums=True)
    try:
        total = sum(e["stored_bytes"] for e in src.manifest["tensors"])
        if not progress:
            return src.verify()
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      transient=True) as bar:
            task = bar.add_task("verify", total=total)
            return src.verify(progress=lambda name, n: bar.advance(task, n))
    finally:
        src.close()


# -- command line ----------------------------------------------------------------------------------

def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", help="HF model directory or .gguf file (with --verify: the store)")
    p.add_argument("dst", nargs="?", help="store directory to create")
    p.add_argument("--verify", action="store_true", help="re-check every checksum of the store SRC and exit")
    p.add_argument("--quant", default="none", choices=QUANT_CHOICES, help="weight quantization (default none)")
    p.add_argument("--group-size", type=int, default=64, choices=sorted(set(Q.GROUP_SIZES + Q.INT4_GROUP_SIZES)),
                   help="NF4 group size (64, 128); int4 group size (32 .. 256)")
    p.add_argument("--double-quant", action="store_true", help="NF4: int8 absmaxes (double quantization)")
    p.add_argument("--dequantize", action="store_true",
                   help="with --quant none: write a GGUF's packed blocks as dense values (default: kept packed)")
    p.add_argument("--keep-high-precision", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="fnmatch patterns of tensor names to leave unquantized (embeddings, LM head, norms "
                        "and routers always are)")
    p.add_argument("--compress", default=None, choices=["zstd"], help="zstd-compress records that shrink")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="high-precision dtype of the store (default: each tensor's source dtype)")
    p.add_argument("--shard-size-mb", type=int, default=2048, help="target shard size in MiB (default 2048)")
    p.add_argument("--force", action="store_true", help="replace an existing store at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `convert` on the `ferry` subparsers."""
    p = subparsers.add_parser("convert", help="convert an HF directory or GGUF file into a ferry store",
                              description=__doc__.split("\n\n")[0])
    _add_args(p)
    return p


def cmd_convert(a: argparse.Namespace) -> None:
    if a.verify:
        if not a.src or a.dst:
            raise FerryError("usage: ferry convert --verify STORE")
        problems = verify(a.src, progress=not a.quiet)
        if problems:
            for p in problems:
                print(f"ferry convert --verify: {p}", file=sys.stderr)
            raise ModelLoadError(f"{a.src}: {len(problems)} corrupt tensor(s); the first: {problems[0]}")
        src = StoreSource(a.src)
        n, b = len(src.keys()), sum(e["stored_bytes"] for e in src.manifest["tensors"])
        src.close()
        print(f"{a.src}: all {n} tensor checksums match ({_fmt_bytes(b)})")
        return
    if not a.src or not a.dst:
        raise FerryError("usage: ferry convert SRC DST [options]  |  ferry convert --verify STORE")
    opts = ConvertOptions(quant=a.quant, group_size=a.group_size, double_quant=a.double_quant, dequantize=a.dequantize,
                          keep_high_precision=tuple(a.keep_high_precision), compress=a.compress, level=a.level,
                          dtype=a.dtype, shard_bytes=a.shard_size_mb << 20, force=a.force)
    report = convert(a.src, a.dst, opts, progress=not a.quiet)
    print_report(report)
