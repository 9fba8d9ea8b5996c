"""What every causal LM module shares: the forward signature and checkpoint-name mapping at load time.

Checkpoint names map onto module parameters by rules: separate q/k/v and gate/up projections fill
shards of fused `Linear`s, per-expert tensors fill rows of `Experts` banks, everything else is copied by
its own name. A family only adds rules for names of its own.

A source that can hand out quantized weights (`get_quantized`, the ferry store) gives them for names that
land on a `Linear` weight (whole, or a shard of a fused one) with the same shape; the `Linear` keeps them
packed (see `layers/linear.py`). Everything else - experts included - arrives dense via `source.get`.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from ferrylm.errors import ModelLoadError
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import Experts
from ferrylm.layers.parallel_experts import SKIP
from ferrylm.layers.params import materializing, writable
from ferrylm.weights.quant import QuantizedTensor

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # transformers v5 in-memory layout
ENGINE_PACKED_FORMATS = {"fp8", "int4", "int4min", "int8", "nf4"}
"""Expert formats the engine keeps packed (every format the fused kernel reads, tests/test_fused_moe_formats.py).
fp8 joined in session 24 (e4m3, one byte a weight like int8; per channel, or group-wise as block-wise FP8
checkpoints load). int8 joined in session 7: on the H200 a packed int8 bank's logits were
1.95e-2 off the dequantized reference over the same contexts (int4 1.94e-2); session 2's 2.1 compared rows after a
flipped near-tie."""
_SHARD = re.compile(r"^(.*)\.(q|k|v|gate|up)_proj\.(weight|bias)$")


HEADER_SLICE_UNIT = 256
"""Columns a header-only slice (`quantized_info`: GGUF blocks of 32, FP8 row groups of 128) must start and end on
for `note_packed_linears` to count it packed: a multiple of every such group; one that is not is counted dense
(the load keeps it packed where its own groups tile it: placement errs on the side of more room)."""


def _header_slice(info, dim: int, start: int, length: int):
    """A tensor-parallel rank's share of a header-only quantized tensor (shape and bytes), or None where the slice
    may cut a group (`HEADER_SLICE_UNIT`)."""
    if dim == 1 and (start % HEADER_SLICE_UNIT or length % HEADER_SLICE_UNIT):
        return None
    shape = tuple(length if d == dim else size for d, size in enumerate(info.shape))
    return SimpleNamespace(shape=shape, nbytes=info.nbytes * length // info.shape[dim])


class CausalLM(nn.Module):
    """Base: subclasses build `self.model` (with `embed_tokens`, `layers`, `norm`) and `self.lm_head`.

    The forward is cut into segments the model runner drives (so it can wait on a layer's weights and
    start the next layer's copy, or replay graphs per segment): `begin_step` (per-step state every layer
    shares, e.g. Yuan's filter bookkeeping), `embed`, `run_layer(i)`, `final_norm`. `forward` chains them
    and is the reference. Families whose layers split into `pre` -> attention -> `post` (Llama) also
    expose those (`layer_pre`, `layer_attention`, `layer_post`) for piecewise CUDA graphs.
    """

    ignored_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)
    cuda_graphs: bool = False
    """The forward reads no host values (no .tolist(), no per-sequence Python state; per-sequence state
    rows come as a device tensor, `ForwardContext.state_rows`): decode can be captured. MoE families
    qualify only when every expert backend is graph-safe (`reads_host` False)."""
    piecewise: bool = False
    """Layers split into `layer_pre` / `layer_attention` / `layer_post` (piecewise graphs for prefill)."""

    def graph_safe(self) -> bool:
        """Capturable now: the family reads no host values and every expert backend computes on device."""
        return self.cuda_graphs and all(not m.backend.reads_host for m in self.modules() if isinstance(m, Experts))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    absent: tuple[str, ...] = ()
    """Name prefixes of modules another pipeline stage holds (`keep_layers`): their tensors are not read."""
    dense_linears: tuple[str, ...] = ()
    """Linear module names (the last part, e.g. "kv_b_proj") whose weights are held dense even from a quantized
    source: the family reads them as dense weights (`Linear.dense_weight`) every step."""

    def skips(self, name: str) -> bool:
        """A checkpoint tensor the family never uses (e.g. DeepSeek-V3's multi-token-prediction layer): not read."""
        return False

    def keep_layers(self, layers: range, embed: bool, head: bool) -> None:
        """Keep only a pipeline stage's part: the layers in `layers`, the embedding if `embed` (or a tied head
        needs it), the final norm and LM head if `head`. The rest become empty placeholders."""
        dropped = []
        for i in range(self.num_layers):
            if i not in layers:
                self.model.layers[i] = nn.Module()
                dropped.append(f"model.layers.{i}.")
        if not embed and not (head and getattr(self, "tied", False)):
            self.model.embed_tokens = nn.Module()
            dropped.append("model.embed_tokens.")
        if not head:
            self.model.norm, self.lm_head = nn.Module(), nn.Module()
            dropped += ["model.norm.", "lm_head."]
        self.absent = tuple(dropped)

    def begin_step(self, device: torch.device):
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, H]

    def run_layer(self, i: int, positions: torch.Tensor, x: torch.Tensor, step) -> torch.Tensor:
        return self.model.layers[i](positions, x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H] (per-step metadata via ForwardContext)."""
        step = self.begin_step(input_ids.device)
        x = self.embed(input_ids)
        for i in range(self.num_layers):
            x = self.run_layer(i, positions, x, step)
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> logits: [N, V] in fp32
        return self.lm_head(hidden).float()

    def map_weight(self, name: str, tensor: torch.Tensor) -> bool | set[str]:
        """Family-specific names; return True when handled (the parameter of that name is filled), or the
        set of load keys it filled (`bank:expert:part` for expert rows, `param:shard` for fused shards).
        `tensor` is a `QuantizedTensor` only for names that are a Linear's own weight of the same shape."""
        return False

    def load_weights(self, source, progress=None, allocator=None) -> None:
        """Fill every parameter from `source`; a parameter still on `meta` gets its storage from
        `allocator` (see `layers/params.py`) when first written."""
        with materializing(self, allocator):
            self._load_weights(source, progress)

    def _load_weights(self, source, progress=None) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        get_quantized = getattr(source, "get_quantized", None)
        for name in source.keys():
            if any(name.endswith(s) for s in self.ignored_weights):
                continue
            if self.absent and name.startswith(self.absent):  # another pipeline stage's tensor
                continue
            if self.skips(name):
                continue
            part = self._tp_part(name, params)
            if part == SKIP:  # an expert another tensor-parallel rank holds: never read here
                continue
            try:
                qt = get_quantized(name) if get_quantized and part is None else None
                if part is not None:  # a sharded layer's slice: a Linear's still packed where it tiles, else dense
                    tensor = self._packed_slice(name, get_quantized, part, params)
                    if tensor is None:
                        get_part = getattr(source, "get_part", None)
                        tensor = get_part(name, *part) if get_part else source.get(name).narrow(*part)
                elif qt is None:
                    tensor = source.get(name)
                else:  # kept packed where a Linear or a packing expert bank takes it, else dequantized here
                    tensor = self._quantized_for_linear(name, qt, params)
                    if tensor is None and self._packing_bank(name) is not None:
                        tensor = qt
                    tensor = qt.dequantize() if tensor is None else tensor
                self._load_one(name, tensor, params, loaded)
            except (ValueError, KeyError, AttributeError) as e:
                raise ModelLoadError(f"{source.path}: tensor {name!r} does not fit the model ({e})") from None
            if progress:
                progress(name)
        for mod in self.modules():
            if isinstance(mod, (Linear, Experts)):
                try:
                    mod.finish_load()
                except ValueError as e:  # e.g. a bank whose experts arrived partly packed, partly dense
                    raise ModelLoadError(f"{source.path}: {e}") from None
            elif isinstance(mod, nn.Embedding) and not mod.weight.is_meta:
                mod.weight.requires_grad_(False)
        for mod in self.modules():  # then the modules built on those (e.g. Yuan's router), their weights final
            if not isinstance(mod, (Linear, Experts)) and callable(getattr(mod, "finish_load", None)):
                mod.finish_load()
        if getattr(self, "tied", False):
            loaded.add("lm_head.weight")
        missing = self._missing(params, loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{source.path}: checkpoint lacks tensors the model needs: {shown}")

    def _tp_part(self, name: str, params):
        """What this rank reads of checkpoint tensor `name`: None (all of it), (dim, start, length) of a
        sharded layer's slice (`tp_part` of `layers/parallel_linear.py`, `layers/parallel_experts.py`),
        or SKIP (an expert bank's expert held by another rank)."""
        if m := _EXPERT.match(name):
            mod, args = m[1], (int(m[2]), _EXPERT_PART[m[3]])
        elif name in params:
            mod, _, attr = name.rpartition(".")
            args = (attr, None)
        elif m := _SHARD.match(name):
            mod, args = f"{m[1]}.{'qkv_proj' if m[2] in 'qkv' else 'gate_up_proj'}", (m[3], m[2])
        else:
            return None
        try:
            mod = self.get_submodule(mod)
        except AttributeError:
            return None
        tp_part = getattr(mod, "tp_part", None)
        if tp_part is None or (isinstance(mod, Experts) != bool(_EXPERT.match(name))):
            return None
        return tp_part(*args)

    def _missing(self, params, loaded: set[str]) -> list[str]:
        """Parameters not fully filled: every shard of a fused Linear and every expert's rows must arrive."""
        missing = []
        for pname in sorted(params):
            if pname in loaded:
                continue
            mod_name, _, attr = pname.rpartition(".")
            mod = self.get_submodule(mod_name)
            if isinstance(mod, Linear) and mod.shards and all(f"{pname}:{s}" in loaded for s in mod.shards):
                continue
            if isinstance(mod, Experts):
                ways = (("gate", "up"), ("gate_up",)) if attr == "w13" else (("down",),)
                if all(any(all(f"{mod_name}:{e}:{p}" in loaded for p in way) for way in ways)
                       for e in range(mod.num_experts)):
                    continue
            missing.append(pname)
        return missing

    def _packed_slice(self, name: str, get_quantized, part, params) -> QuantizedTensor | None:
        """A tensor-parallel rank's slice `part` of a Linear's packed weight, still packed (`QuantizedTensor.narrow`:
        whole scale groups and code bytes), or None: the slice is read dense."""
        if (get_quantized is None or not name.endswith(".weight") or _EXPERT.match(name)
                or not self._sliceable(name, params)):
            return None
        qt = get_quantized(name)
        return self._quantized_for_linear(name, qt.narrow(*part) if qt is not None else None, params)

    def _sliceable(self, name: str, params) -> bool:
        """Whether the module `name` loads into computes from a packed slice (a vocabulary-parallel table's lookup
        reads its dense rows: `ParallelVocabEmbedding.packed_slice`)."""
        if name not in params:
            return True
        return getattr(self.get_submodule(name[: -len(".weight")]), "packed_slice", True)

    def _quantized_for_linear(self, name: str, qt: QuantizedTensor | None, params) -> QuantizedTensor | None:
        """`qt` when `name` lands on a Linear's weight (or one shard of it) of the same shape, else None."""
        if qt is None or not name.endswith(".weight") or _EXPERT.match(name):
            return None
        if self.dense_linears and name.rsplit(".", 2)[-2] in self.dense_linears:
            return None
        if name in params:
            mod = self.get_submodule(name[: -len(".weight")])
            return qt if isinstance(mod, Linear) and tuple(params[name].shape) == tuple(qt.shape) else None
        if m := _SHARD.match(name):
            try:
                mod = self.get_submodule(f"{m[1]}.{'qkv_proj' if m[2] in 'qkv' else 'gate_up_proj'}")
            except AttributeError:
                return None
            if isinstance(mod, Linear) and m[2] in mod.shards and tuple(qt.shape) == (mod.shards[m[2]][1], mod.in_features):
                return qt
        return None

    def _packing_bank(self, name: str):
        """The expert bank a checkpoint name's rows go to when that bank keeps its experts packed."""
        m = _EXPERT.match(name)
        if not m:
            return None
        try:
            bank = self.get_submodule(m[1])
        except AttributeError:
            return None
        return bank if isinstance(bank, Experts) and bank.packing else None

    def note_packed_linears(self, source) -> int:
        """Record on each Linear the bytes its weight will keep packed (`packed_nbytes`), so placement sizes
        it at that, not at its dense shape. Returns how many checkpoint tensors stay packed. A source with
        `quantized_info` (GGUF, a block-wise FP8 checkpoint) answers shape and bytes without reading or decoding what the
        load reads again."""
        get_quantized = getattr(source, "quantized_info", None) or getattr(source, "get_quantized", None)
        if get_quantized is None:
            return 0
        params = dict(self.named_parameters())
        n = 0
        for name in source.keys():
            if not name.endswith(".weight") or _EXPERT.match(name) or self.skips(name):  # never a Linear's packed weight
                continue
            part = self._tp_part(name, params)
            if part == SKIP or (part is not None and not self._sliceable(name, params)):  # not read / read dense
                continue
            info = get_quantized(name)
            if part is not None and info is not None:  # a tensor-parallel rank's slice, as the load takes it
                info = (info.narrow(*part, contiguous=False) if isinstance(info, QuantizedTensor)
                        else _header_slice(info, *part))
            qt = self._quantized_for_linear(name, info, params)
            if qt is None:
                continue
            m = _SHARD.match(name)
            mod = self.get_submodule(name[: -len(".weight")] if name in params else
                                     f"{m[1]}.{'qkv_proj' if m[2] in 'qkv' else 'gate_up_proj'}")
            mod.packed_nbytes = (mod.packed_nbytes or 0) + qt.nbytes
            n += 1
        return n

    def pack_experts(self, source) -> list[str]:
        """Let expert banks keep a quantized source's experts packed (the fused kernel reads them): a bank
        packs when its first expert's gate/up/down are all stored in one format the kernel reads; its
        per-expert bytes (`packed_nbytes`) then size the placement. Returns the banks that pack."""
        from ferrylm.layers.fused_moe import expert_format

        get_quantized = getattr(source, "get_quantized", None)
        banks = {n: m for n, m in self.named_modules() if isinstance(m, Experts)}
        if get_quantized is None or not banks:
            return []
        first: dict[str, dict[str, object]] = {}
        for name in source.keys():
            m = _EXPERT.match(name)
            if m and m[1] in banks and m[2] == "0":
                first.setdefault(m[1], {})[m[3]] = get_quantized(name)
        packed = []
        for bname, parts in first.items():
            qts = list(parts.values())
            if len(qts) < 2 or any(q is None for q in qts):
                continue
            fmts = {expert_format(q) for q in qts}
            if len(fmts) != 1 or not fmts <= ENGINE_PACKED_FORMATS:
                continue
            bank = banks[bname]
            bank.packing, bank.packed_nbytes, bank.packed_format = True, sum(q.nbytes for q in qts), fmts.pop()
            packed.append(bname)
        return packed

    def _load_one(self, name, tensor, params, loaded) -> None:
        if done := self.map_weight(name, tensor):
            loaded.update(done if isinstance(done, set) else {name})
            return
        if m := _EXPERT.match(name):
            mod: Experts = self.get_submodule(m[1])
            e = int(m[2]) - getattr(mod, "first_expert", 0)  # the bank's own index (expert-parallel banks)
            mod.load(e, _EXPERT_PART[m[3]], tensor)
            loaded.add(f"{m[1]}:{e}:{_EXPERT_PART[m[3]]}")
            return
        if m := _FUSED_EXPERTS.match(name):
            mod = self.get_submodule(m[1])
            if getattr(mod, "tp", None) is not None and mod.tp.size > 1:
                raise ValueError("stacked expert tensors cannot be sharded over tensor-parallel ranks")
            part = "gate_up" if m[2] == "gate_up_proj" else "down"
            for e in range(mod.num_experts):
                mod.load(e, part, tensor[e])
                loaded.add(f"{m[1]}:{e}:{part}")
            return
        if name in params:
            p = params[name]
            if isinstance(tensor, QuantizedTensor):  # a Linear's own weight, kept packed
                self.get_submodule(name[: -len(".weight")]).load("weight", tensor)
                loaded.add(name)
                return
            mod_name, _, attr = name.rpartition(".")
            mod = self.get_submodule(mod_name)
            if isinstance(mod, Linear) and hasattr(mod, "tp_part"):  # a sharded layer: its slice, its checks
                mod.load(attr, tensor)
                loaded.add(name)
                return
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"shape {tuple(tensor.shape)} != {tuple(p.shape)}")
            writable(self.get_submodule(mod_name), attr).copy_(tensor)
            loaded.add(name)
            return
        if m := _SHARD.match(name):
            fused = "qkv_proj" if m[2] in "qkv" else "gate_up_proj"
            mod_name = f"{m[1]}.{fused}"
            mod: Linear = self.get_submodule(mod_name)
            mod.load(m[3], tensor, shard=m[2])
            loaded.add(f"{mod_name}.{m[3]}:{m[2]}")
            return
        raise KeyError(f"no parameter for checkpoint tensor {name!r}")
