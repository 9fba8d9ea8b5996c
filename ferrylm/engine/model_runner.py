"""ModelRunner: owns the model module and the cache tensors on one device, and turns a
`SchedulerOutput` into batch tensors, runs the forward pass and returns the logits to sample.

It knows devices, dtypes and tensors; it knows nothing about requests, tokenizers or sampling policy.
Notation: T tokens in the step, B sequences, N sequences that sample this step, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import logging
import time
import weakref
from array import array
from dataclasses import dataclass, field

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.scheduler import SchedulerOutput
from ferrylm.engine.staging import upload
from ferrylm.errors import ConfigError
from ferrylm.kv.cache import KV_DTYPES, KVCache, SequenceStatePool
from ferrylm.layers.attention import PagedAttention, resolve_backend
from ferrylm.layers.context import ForwardContext, costliest_routing, forward_context
from ferrylm.layers.moe import Experts
from ferrylm.layers.parallel_linear import kv_heads_per_rank
from ferrylm.layers.rotary import RotaryEmbedding
from ferrylm.layers.transfer import to_device
from ferrylm.models.registry import model_class
from ferrylm.offload.placed_weights import PlacedWeights
from ferrylm.offload.memory import (activation_reserve, cublas_workspace_bytes, device_budget, fixed_kv_bytes,
                                   graph_step_floor, graph_token_limit, graph_tokens, kv_after_warmup, size_memory,
                                   warmup_activations)
from ferrylm.offload.placement import describe, group_tensors
from ferrylm.parallel.group import SINGLE, building

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(name: str, device: torch.device, model_config: ModelConfig) -> torch.dtype:
    if name != "auto":
        try:
            return DTYPES[name]
        except KeyError:
            raise ConfigError(f"unsupported dtype {name!r}; choose float32, bfloat16 or float16") from None
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model_config.torch_dtype == "float16" else torch.bfloat16


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA GPU on this machine")
    return device


def _weakly(method):
    """A bound method called through a weak reference to its object (the object must outlive the calls)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def decode_groups(lens: list[int], budget: int) -> list[tuple[int, int, int]]:
    """Split decode rows (in order) into groups whose rows x longest context stays within `budget` tokens."""
    groups, start, longest = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and (i + 1 - start) * max(longest, n) > budget:
            groups.append((start, i, longest))
            start, longest = i, 0
        longest = max(longest, n)
    if lens:
        groups.append((start, len(lens), longest))
    return groups


@dataclass
class StepInput:
    """One step as plain values (no `Sequence`s): what `ModelRunner.run` needs. Rank 0 builds it from the
    scheduler's output and ships it as it is to tensor-parallel workers (`parallel/executor.py`)."""

    input_ids: list[int]
    """[T] the step's new tokens, sequence after sequence."""
    positions: list[int]
    """[T] their positions."""
    slots: list[int]
    """[T] the KV cache slot each new token's K/V goes to."""
    query_start_loc: list[int]
    """[B + 1] offsets of each sequence's tokens."""
    start_pos: list[int]
    """[B] tokens already cached per sequence."""
    seq_lens: list[int]
    """[B] context length after the step."""
    block_tables: list[list[int]]
    """[B, max_blocks] padded with 0 (rows are lists or int64 arrays)."""
    num_decodes: int
    state_slots: list[int | None]
    """[B] per-sequence state row (models with non-KV state)."""
    sample_rows: list[int]
    """Rows of the flat token batch whose logits are returned: sampling rows, then prompt-logprob rows."""
    gather_dst: list[int] = field(default_factory=list)
    """Positions in `input_ids` whose token is still on the device (async scheduling; 0 stands in) ..."""
    gather_src: list[int] = field(default_factory=list)
    """... and the row of the previous step's sampled ids that holds each."""


@dataclass
class PrevTokens:
    """The previous step's sampled ids, still on the device: the input of sequences whose last token's
    value the host does not know yet (async scheduling)."""

    token_ids: torch.Tensor
    """[N] long on the device, one per sampled row of that step."""
    rows: dict[int, int]
    """seq_id -> its row in `token_ids`."""


class ModelRunner:
    decode_gather_tokens = 1 << 16
    """Decode attention gathers each group's K/V into [rows, max_len]: this caps rows x max_len."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, source, max_model_len: int,
                 progress=None, dist=None):
        self.config, self.model_config = config, model_config
        self.dist = dist
        """`parallel.dist.Dist` of this rank when the engine runs over several processes, else None."""
        self.tp = dist.tp if dist is not None else SINGLE
        self.kv_heads = kv_heads_per_rank(model_config.num_key_value_heads, self.tp.size)
        """KV heads this rank caches (all of them in one process)."""
        self.pipelined = dist is not None and dist.pp_size > 1
        self.layers = range(model_config.num_hidden_layers)
        """The layers this rank runs (a pipeline stage's range; all of them otherwise)."""
        if self.pipelined:
            from ferrylm.parallel.pipeline import stage_layers

            self.layers = stage_layers(model_config.num_hidden_layers, dist.pp_size, dist.stage)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.block_size = config.cache.block_size
        self.kv_dtype = KV_DTYPES.get(config.cache.kv_cache_dtype)  # None: the model's dtype
        self.attention_backend = resolve_backend(config.attention_backend, self.device, self.kv_dtype)
        self.max_model_len = max_model_len
        # what this engine allocates is measured from here (other engines may share the device)
        self._mem_base = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        cls = model_class(model_config)
        if self.tp.size > 1 and not getattr(cls, "tensor_parallel", False):
            raise ConfigError(f"{cls.__name__} does not support tensor_parallel_size > 1 yet (docs/parallel.md)")
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # shapes only: each tensor gets memory once, where placement puts it; sharded layers take this
            # rank's share
            with torch.device("meta"), building(self.tp):
                self.model = cls(model_config, **config.model_overrides)
        except TypeError as e:
            if not config.model_overrides:
                raise
            raise ConfigError(f"model option(s) {sorted(config.model_overrides)} not accepted by "
                              f"{cls.__name__}: {e}") from None
        finally:
            torch.set_default_dtype(prev)
        if self.pipelined:
            self.model.keep_layers(self.layers, dist.first_stage, dist.last_stage)
        self.model.eval()
        from ferrylm.layers import fused_moe

        packed = []
        # tensor-parallel ranks read their expert slices dense (parallel/, models/base.py); a pipeline stage
        # holds whole layers and packs its banks as one process does
        if (self.device.type == "cuda" and config.moe_backend == "auto" and fused_moe.triton is not None
                and self.dtype in (torch.bfloat16, torch.float16) and config.parallel.tensor_parallel_size == 1):
            packed = self.model.pack_experts(source)  # the fused kernel reads them packed: placed at that size
            if packed:
                log.info("experts kept packed in %d banks (read by the fused MoE kernel)", len(packed))
        self._graph_limit = graph_token_limit(model_config, bool(packed))
        """The most tokens a captured step may hold (packed expert banks: their prefill path is not capturable)."""
        self._experts_format = next((m.packed_format for m in self.model.modules()
                                     if isinstance(m, Experts) and m.packing), None)
        """The packed expert banks' kernel format (None: dense): a captured step's floor (`graph_step_floor`)."""
        if self.device.type == "cuda":  # packed Linear weights are placed (and streamed) at their packed size
            self.model.note_packed_linears(source)
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.backend = self.attention_backend
        placement, kv_bytes = self._place()
        from ferrylm.offload import expert_profile

        profile = config.offload.expert_profile or expert_profile.saved(config.model)  # --profile-experts saved it
        self.placed = PlacedWeights(self.model, placement, self.device, config.offload.expert_cache_policy,
                                    profile, config.offload.stream_buffers,
                                    config.moe_backend, config.offload.experts, config.offload.cpu_threads,
                                    config.offload.mapped_experts, config.offload.cpu_share,
                                    cpu_numa_node=config.offload.cpu_numa_node,
                                    hybrid_split=config.offload.hybrid_split)
        self.model.load_weights(source, progress=progress, allocator=self.placed)
        meta = [n for n, p in self.model.named_parameters() if p.is_meta]
        if meta:  # load_weights reports missing tensors; this is a model whose loader skipped one
            raise ConfigError(f"parameters never loaded: {', '.join(meta[:5])}")
        self.placed.finish()
        if dist is not None:  # every rank loaded (a slow or failed one is named) before any collective
            dist.sync("weights loaded")
        self.embed_on_host = self.placed.embed_device.type != self.device.type
        for m in self.model.modules():  # RoPE tables before the KV cache takes the free memory, and only
            if isinstance(m, RotaryEmbedding):  # as long as the engine's context (128k-position models)
                m.max_positions = min(m.max_positions, max_model_len)
                m._table(self.device)
        self.placement = placement
        self.activation_bytes = self.weights_allocated = self.step_peak = self.load_peak = None
        if self.device.type == "cuda" and self._budget is not None:
            kv_bytes = self._kv_after_warmup(kv_bytes)
        self.kv_cache = self._allocate_kv(kv_bytes)
        self.state_pool = self._allocate_state()
        text = describe(placement, self.kv_cache.nbytes, self.kv_cache.num_blocks * self.block_size,
                        model_config.num_experts_per_tok or None, config.offload.experts == "cpu")
        (log.warning if not placement.fully_resident else log.info)("%s", text)
        self.placement_text = text
        self.graphs = self.piecewise = None
        # offloaded models graph their decode steps when nothing is streamed and every cached expert bank
        # reads misses in place (up to `graph_tokens` rows); prefill then runs eagerly
        graphs_ok = (self.device.type == "cuda" and not config.enforce_eager and self.model.graph_safe()
                     and (placement.fully_resident or self.placed.graphable)
                     and dist is None)  # TODO(parallel): graphs with collectives inside
        if graphs_ok:
            from ferrylm.engine.cuda_graph import PiecewiseGraphs

            self.graphs = self.decode_graphs()
            if self.model.piecewise and placement.fully_resident:
                self.piecewise = PiecewiseGraphs(self.model, self._graph_tokens(True), self.dtype, self.device)

    def decode_graphs(self):
        """`DecodeGraphs` over this runner's eager step, cache and state pool (off CUDA: the same inputs and
        padding, run uncaptured; the CPU tests set `runner.graphs` to this)."""
        from ferrylm.engine.cuda_graph import DecodeGraphs

        sc, cfg = self.config.scheduler, self.model_config
        max_batch = min(sc.max_num_seqs, self.placed.graph_tokens or sc.max_num_seqs,
                        self._graph_limit or sc.max_num_seqs)
        # the graphs hold the runner weakly: a runner <-> graphs cycle would keep a dropped engine's device
        # memory (graph pools, KV, weights) until the collector ran
        return DecodeGraphs(_weakly(self.embed), _weakly(self._logits_of),
                            self.kv_cache, max_batch, self.max_model_len, cfg.vocab_size, self.device,
                            embed_in_graph=not self.embed_on_host, hidden_size=cfg.hidden_size, dtype=self.dtype,
                            state=self.state_pool)

    def _logits_of(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, H] -> logits [B, V]: the decode graphs' body."""
        return self.model.compute_logits(self.run_layers(x, pos))

    # -- memory -----------------------------------------------------------------------------------

    def _kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        return KVCache.bytes_per_block(len(self.layers), self.block_size, self.kv_heads,
                                       cfg.head_dim, self.dtype, cfg.v_cache_dim, self.kv_dtype)

    def _activation_reserve(self, resident: bool) -> int:
        """The planned activation reserve (`offload/memory.py`); on CUDA the warm-up measures the real one."""
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return activation_reserve(self.model_config, self.config.scheduler, elt, self._graph_tokens(resident),
                                  self._workspace(), self._experts_format)

    def _workspace(self) -> int:
        """cuBLAS's workspace for the graphs' side stream on this device (`offload/memory.py`)."""
        major = torch.cuda.get_device_capability(self.device)[0] if self.device.type == "cuda" else 9
        return cublas_workspace_bytes(major)

    def _graph_tokens(self, resident: bool) -> int:
        """Tokens of the largest graph-captured step (`offload/memory.py` graph_tokens): piecewise prefill graphs
        only for fully resident models; none on TP / PP ranks, which run eager. (Asked before placement gives the
        experts their backends, so `graph_safe` cannot narrow it yet.)"""
        graphs = self.device.type == "cuda" and not self.config.enforce_eager and self.dist is None
        return graph_tokens(self.config.scheduler, graphs, resident and self.model.piecewise, self._graph_limit)

    def _warmup_peak(self) -> int:
        """Device bytes one step at the token budget allocates beyond the weights, measured: a dummy
        prefill of `max_num_batched_tokens` tokens (K/V written to a scratch pool; the experts routed as the
        costliest prompt would route them) and the logits of `max_num_seqs` rows (`warmup_activations` adds the
        sampler's work tensors)."""
        cfg, sc = self.model_config, self.config.scheduler
        T = min(sc.max_num_batched_tokens, self.max_model_len)
        # a real table over T tokens of scratch KV: the Triton prefill reads the chunk back from the cache
        nb = (T + self.block_size - 1) // self.block_size
        kv = self._stage_kv(KVCache(len(self.layers), nb, self.block_size, self.kv_heads, cfg.head_dim,
                                    self.dtype, self.device, v_head_dim=cfg.v_cache_dim, kv_dtype=self.kv_dtype))
        ctx = ForwardContext(query_start_loc=[0, T], start_pos=[0], seq_lens=[T],
                             slot_mapping=torch.arange(T, dtype=torch.long, device=self.device),
                             block_tables=torch.arange(nb, dtype=torch.long, device=self.device)[None],
                             num_decodes=0, kv_cache=kv, state_slots=[None], state=None)
        ids = torch.randint(0, cfg.vocab_size, (T,), device=self.device)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        # the reset below forgets the build's peak (placement, loading, calibration): kept for `ferry plan --check`
        self.load_peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # routed as the costliest prompt would be (`context.costliest_routing`): no prompt's routing takes more
        with torch.inference_mode(), forward_context(ctx), costliest_routing():
            x_in = None if not self.pipelined or self.dist.first_stage else \
                torch.randn(T, cfg.hidden_size, dtype=self.dtype, device=self.device)  # no neighbours in the warm-up
            hidden = self.forward(ids, torch.arange(T, device=self.device), x_in)
            if not self.pipelined or self.dist.last_stage:
                self.model.compute_logits(hidden[:min(T, sc.max_num_seqs)])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del kv, ctx, hidden
        self.placed.stats.reset()  # the warm-up's copies are not the workload's
        return peak

    def _kv_after_warmup(self, planned: int) -> int:
        """The KV pool from what is left of the budget once the weights sit where they are and one step's
        activations are measured (`offload/memory.py`, the rule `ferry plan` predicts with)."""
        self.step_peak = self._warmup_peak()
        tokens = self._graph_tokens(self.placement.fully_resident)
        floor = graph_step_floor(self.model_config, tokens, self.dtype.itemsize, self._experts_format)
        self.activation_bytes = warmup_activations(self.step_peak, self.config.scheduler, self.model_config.vocab_size,
                                                   tokens, self._workspace(), floor)
        used = torch.cuda.memory_allocated(self.device) - self._mem_base
        self.weights_allocated = used  # measured: what the placed weights take (`ferry plan --check`)
        kv, left = kv_after_warmup(self._budget, used, self.activation_bytes, self._fixed_kv,
                                   self._kv_bytes_per_block(), self.max_model_len, self.block_size)
        if self._fixed_kv is not None and left < self._fixed_kv:
            log.warning("the KV cache asked for (%.2f GiB) exceeds what the budget leaves after weights and "
                        "measured activations (%.2f GiB)", self._fixed_kv / 2**30, left / 2**30)
        elif self._fixed_kv is None:
            log.info("KV cache from the measured warm-up: %.2f GiB (planned %.2f GiB; activations %.2f GiB)",
                     kv / 2**30, planned / 2**30, self.activation_bytes / 2**30)
        return kv

    def _place(self):
        """(placement, KV bytes) by `offload/memory.py`, the rule `ferry plan` predicts with; keeps the budget
        and any fixed KV size for the measured warm-up."""
        oc, sc = self.config.offload, self.config.scheduler
        if self.pipelined:  # a rule for another stage's layers is that stage's; one matching no layer at all
            from ferrylm.offload.placement import PlaceRule  # still fails on every stage

            def elsewhere(rule) -> bool:
                r = PlaceRule.parse(rule)
                lo, hi = r.layers or (None, None)
                return r.layers is not None and not any(lo <= i <= hi for i in self.layers) \
                    and lo < self.model_config.num_hidden_layers

            oc = dataclasses.replace(oc, place=tuple(r for r in oc.place if not elsewhere(r)))
        total = free = None
        if oc.gpu_memory_budget is None and oc.gpu_memory_utilization is not None and self.device.type != "cuda":
            log.warning("--gpu-memory-utilization %g: the CPU engine has no device memory to share out; it changes "
                        "nothing (--gpu-memory-budget places the model under a budget)", oc.gpu_memory_utilization)
        if oc.gpu_memory_budget is None and self.device.type == "cuda":
            import gc

            gc.collect()  # an engine dropped before this one may still hold its KV pool inside a reference cycle
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(self.device).total_memory
            free, _ = torch.cuda.mem_get_info(self.device)
        per_block = self._kv_bytes_per_block()
        self._budget = device_budget(oc, total, free)
        self._fixed_kv = fixed_kv_bytes(self.config.cache, per_block)
        cuda = self.device.type == "cuda"
        return size_memory(group_tensors(self.model), per_block, self.max_model_len, self.config.cache, sc, oc,
                           self._budget, self._activation_reserve(False) if cuda else 0, on_cpu=not cuda,
                           resident_reserve=self._activation_reserve(True) if cuda else 0)

    def _allocate_kv(self, nbytes: int) -> KVCache:
        cfg = self.model_config
        per_block = self._kv_bytes_per_block()
        num_blocks = int(nbytes // per_block)
        if self.dist is not None:  # one block table for all ranks: the smallest pool
            num_blocks = self.dist.min_int(num_blocks)
        if num_blocks < 2:
            raise ConfigError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size, num_blocks * per_block / 2**30)
        return self._stage_kv(KVCache(len(self.layers), num_blocks, self.block_size, self.kv_heads, cfg.head_dim,
                                      self.dtype, self.device, v_head_dim=cfg.v_cache_dim, kv_dtype=self.kv_dtype))

    def _stage_kv(self, cache: KVCache):
        """A pipeline stage caches its own layers only, addressed by global layer index."""
        if not self.pipelined:
            return cache
        from ferrylm.parallel.pipeline import StageKV

        return StageKV(cache, self.layers.start)

    def _allocate_state(self) -> SequenceStatePool | None:
        specs = self.model.state_specs() if hasattr(self.model, "state_specs") else None
        if not specs:
            return None
        return SequenceStatePool(self.config.scheduler.max_num_seqs, specs, self.device)

    # -- one step ---------------------------------------------------------------------------------

    def describe(self, out: SchedulerOutput, extra_rows: list[int] = (), pending: dict[int, int] | None = None) -> StepInput:
        """The step as plain values; `extra_rows` (indices into the flat token batch) follow the sampling rows.
        `pending`: seq_id -> row of the previous step's sampled ids, for sequences whose last token is
        still on the device (`PrevTokens.rows`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        gather_dst: list[int] = []
        gather_src: list[int] = []
        qsl, starts, lens, sample_rows = [0], [], [], []
        end = 0
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start, table, tokens = seq.num_computed_tokens, seq.block_table, seq.token_ids
            if n == 1:  # a decode (most rows): no slices
                if start < len(tokens):
                    input_ids.append(tokens[start])
                else:  # pending: its value comes from the device
                    gather_dst.append(end)
                    gather_src.append(pending[seq.seq_id])
                    input_ids.append(0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                known = tokens[start:start + n]
                if len(known) < n:  # only the last token can be pending
                    gather_dst.append(end + n - 1)
                    gather_src.append(pending[seq.seq_id])
                    known.append(0)
                input_ids += known
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            end += n
            qsl.append(end)
            starts.append(start)
            lens.append(start + n)
            if start + n == len(tokens) + seq.num_pending:  # out.samples(i): the last uncomputed token yields logits
                sample_rows.append(end - 1)
        num_decodes = 0
        while num_decodes < len(out.seqs) and out.num_new_tokens[num_decodes] == 1:
            num_decodes += 1
        rows = self._table_rows(out.seqs)
        width = max(len(r) for r in rows)
        zeros = array("q", bytes(8 * width))
        tables = [r + zeros[:width - len(r)] if len(r) < width else r for r in rows]
        return StepInput(input_ids, positions, slots, qsl, starts, lens, tables, num_decodes,
                         [s.state_slot for s in out.seqs], sample_rows + list(extra_rows), gather_dst, gather_src)

    _tables: dict[int, tuple[list[int], array]] = {}

    def _table_rows(self, seqs) -> list[array]:
        """Each sequence's block table as an int64 array, kept from step to step and extended by the blocks
        it gained, so a step copies whole rows instead of converting every block id again. A table only
        grows by appending while its sequence holds it (kv/block_manager.py); a replaced list is rebuilt."""
        old, new, rows = self._tables, {}, []
        for s in seqs:
            bt = s.block_table
            got = old.get(s.seq_id)
            if got is None or got[0] is not bt or len(got[1]) > len(bt):
                got = (bt, array("q", bt))
            elif len(got[1]) < len(bt):
                got[1].extend(bt[len(got[1]):])
            new[s.seq_id] = got
            rows.append(got[1])
        self._tables = new  # sequences that left the batch are dropped
        return rows

    def tensors(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """ids, positions [T] and the step's `ForwardContext`, on this runner's device."""
        return self._tensors(step)[:3]

    def _tensors(self, step: StepInput, prev: torch.Tensor | None = None):
        """(ids, positions, context, sample rows): every integer input crosses in one host -> device copy;
        pending ids are filled on the device from `prev`, the previous step's sampled ids."""
        dev, nd, lens = self.device, step.num_decodes, step.seq_lens
        B, W = len(step.block_tables), len(step.block_tables[0]) if step.block_tables else 0
        flat = array("q")
        for row in step.block_tables:  # [B, W]: rows may be the runner's cached arrays, read now
            flat.extend(row)
        ids, pos, slots, dlens, tables, rows, dst, src = upload(
            [step.input_ids, step.positions, step.slots, lens[:nd], flat, step.sample_rows, step.gather_dst,
             step.gather_src], dev)
        if step.gather_dst:
            ids[dst] = prev[src]
        ctx = ForwardContext(
            query_start_loc=step.query_start_loc, start_pos=step.start_pos, seq_lens=lens,
            slot_mapping=slots, block_tables=tables.view(B, W),  # [B, max_blocks]
            num_decodes=nd, kv_cache=self.kv_cache, state_slots=step.state_slots, state=self.state_pool,
            decode_seq_lens=dlens if nd else None,
            decode_max_len=max(lens[:nd], default=0),
            decode_groups=decode_groups(lens[:nd], self.decode_gather_tokens),
        )
        return ids, pos, ctx, rows

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        step = self.describe(out)
        return *self.tensors(step), step.sample_rows

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The eager step, with the runner owning the layer loop: ids, pos [T] -> hidden states [T, H].
        Around each layer the placed weights wait for that layer's copy and start the next one's.
        A pipeline stage after the first starts from `hidden_in` [T, H]; one before the last returns its
        last layer's output (no final norm)."""
        return self.run_layers(self.embed(ids) if hidden_in is None else hidden_in, pos)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> embeddings [T, H] on the device (looked up on the host when the table lives there)."""
        if not self.embed_on_host:
            return self.model.embed(ids)
        # the ids come back first (a sync where they are the device's), the rows go over through pinned memory
        return to_device(self.model.embed(ids.cpu()), self.device)

    def run_layers(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, H] -> final hidden states [T, H] (a pipeline stage: its layers only)."""
        model, weights = self.model, self.placed
        step = model.begin_step(self.device)
        for i in self.layers:
            weights.before_layer(i)
            x = model.run_layer(i, pos, x, step)
            weights.after_layer(i)
        if self.pipelined and not self.dist.last_stage:
            return x
        return model.final_norm(x)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, extra_rows: list[int] = (), prev: PrevTokens | None = None) -> torch.Tensor:
        """Run one step; returns logits [N, V] (fp32) for the sequences with `out.samples(i)`, in order, then
        those of `extra_rows` (indices into the step's flat token batch: prompt logprobs). `prev`: the
        previous step's sampled ids on the device, for sequences whose last token is pending.
        On CUDA nothing here waits for the device: the step is queued and the logits are its output."""
        t = time.perf_counter()
        self._apply_pending_share()
        self.placed.before_step()
        try:
            return self._execute(out, extra_rows, prev)
        finally:
            decode = len(out.seqs) if out.num_batched_tokens == len(out.seqs) else None  # for the share tuner
            self.placed.after_step(time.perf_counter() - t, decode)  # expert slots follow mapped steps' routing

    def _apply_pending_share(self) -> None:
        """Between steps: the share hybrid decode's re-balance or tuner queued (`PlacedWeights.pending_share`)."""
        if self.placed.pending_share is not None and self.placed.apply_pending_share() and self.graphs is not None:
            self.graphs.reset()  # the column split is baked into captures

    def recapture_graphs(self) -> None:
        """Capture the CUDA graphs again on next use: after switching on something a capture bakes in or leaves
        out (`offload/expert_profile.start`'s routing counts and trace are Python-side switches)."""
        for g in (self.graphs, self.piecewise):
            if g is not None:
                g.reset()

    def check_step(self) -> None:
        """Once a step's results are on the host: raise what its host expert worker hit (the step's tokens
        are then dropped, not streamed); the expert slots read the step's routing counts."""
        if self.placed.host_decode is not None:
            self.placed.host_decode.check()
        self.placed.after_results()

    closed = False

    def close(self) -> None:
        """Release what this engine holds now rather than when the collector finds it (idempotent; no step
        runs afterwards): the queued steps are drained, the hybrid decode worker, the host expert pool and
        the host-kernel build thread end, the host tier is unregistered (`PlacedWeights.close`), and the
        graphs (their pools), the KV and state pools and the model are dropped; on CUDA the allocator's
        cached blocks go back to the device, so the next engine in the process sees them free."""
        if self.closed:
            return
        self.closed = True
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self.graphs = self.piecewise = None
        self.placed.close()
        self.kv_cache = self.state_pool = None
        self.model = None
        self._tables = {}
        if cuda:
            torch.cuda.empty_cache()

    def run_shipped(self, step: StepInput) -> torch.Tensor | None:
        """`run` plus the per-step bookkeeping `execute` does: what every rank of a parallel engine runs (each
        rank re-balances and tunes its own hybrid share on its own steps)."""
        t = time.perf_counter()
        self._apply_pending_share()
        self.placed.before_step()
        try:
            return self.run(step)
        finally:
            decode = len(step.seq_lens) if len(step.input_ids) == len(step.seq_lens) else None  # for the tuner
            self.placed.after_step(time.perf_counter() - t, decode)

    prepare_s = 0.0
    """Host seconds the last `execute` spent building its inputs (benchmarks read it)."""

    def _execute(self, out: SchedulerOutput, extra_rows, prev: PrevTokens | None) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.graphs is not None and not extra_rows and self.graphs.eligible(out):
            return self._graph_step(out, prev, t0)
        step = self.describe(out, extra_rows, prev.rows if prev is not None else None)
        return self.run(step, prev.token_ids if prev is not None else None, t0)

    def _graph_step(self, out: SchedulerOutput, prev: PrevTokens | None, t0: float) -> torch.Tensor:
        """A pure decode step on a captured graph: its static input buffers are filled from one host ->
        device copy (`DecodeGraphs.run` is the plain reference: one pageable copy per buffer).
        Logits [B, V] are a view of the graphs' shared buffer, valid until the next replay is queued."""
        from ferrylm.engine.cuda_graph import _bucket

        g, bs = self.graphs, self.block_size
        B = len(out.seqs)
        Bb = _bucket(B, g.batch_buckets)
        ids, pos, slots, dst, src = [], [], [], [], []
        for r, s in enumerate(out.seqs):
            p = s.num_computed_tokens
            if p < len(s.token_ids):
                ids.append(s.token_ids[p])
            else:  # pending: the previous step sampled it on the device
                ids.append(0)
                dst.append(r)
                src.append(prev.rows[s.seq_id])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        nbb = _bucket((max(pos) + bs) // bs, g.block_buckets)  # blocks of the longest context (pos + 1 tokens)
        scratch, pad = self.kv_cache.scratch_block, Bb - B
        fill = array("q", [scratch]) * nbb
        tables = array("q")
        for row in self._table_rows(out.seqs):  # [Bb, nbb], padded with the scratch block
            tables.extend(row[:nbb])
            if len(row) < nbb:
                tables.extend(fill[:nbb - len(row)])
        for _ in range(pad):
            tables.extend(fill)
        rows = [s.state_slot for s in out.seqs] + [g.scratch_row] * pad if g.state is not None else []
        d_ids, d_pos, d_slots, d_tables, d_dst, d_src, d_rows = upload(
            [ids + [0] * pad, pos + [0] * pad, slots + [scratch * bs] * pad, tables, dst, src, rows], self.device)
        g.ids[:Bb].copy_(d_ids)
        if rows:  # the filter state rows of a stateful model; padded rows: the pool's scratch row
            g.state_rows[:Bb].copy_(d_rows)
        g.pos[:Bb].copy_(d_pos)
        g.slots[:Bb].copy_(d_slots)
        g.lens[:Bb].copy_(d_pos + 1)  # context length after the step; padded rows: 1
        g.tables[:Bb, :nbb].copy_(d_tables.view(Bb, nbb))  # [Bb, nbb]
        g.live.fill_(B)  # real rows: the host expert worker computes only these
        if dst:
            g.ids[d_dst] = prev.token_ids[d_src]
        if not g.embed_in_graph:  # the table lives on the host: look up host ids when they are all known
            g.x[:Bb].copy_(self.embed(g.ids[:Bb] if dst else torch.tensor(ids + [0] * pad)))
        graph, logits = g._graph(Bb, nbb)
        self.prepare_s = time.perf_counter() - t0
        graph.replay()
        return logits[:B]

    @torch.inference_mode()
    def run(self, step: StepInput, prev: torch.Tensor | None = None, t0: float | None = None) -> torch.Tensor:
        """The eager (or piecewise-graph) step of a plain description: logits [N, V] (fp32) of
        `step.sample_rows`. Tensor-parallel workers run exactly this on the step rank 0 ships.
        `prev`: the previous step's sampled ids on the device (`step.gather_src` indexes it)."""
        if self.pipelined:
            return self._run_stage(step)
        ids, pos, ctx, rows = self._tensors(step, prev)
        if t0 is not None:
            self.prepare_s = time.perf_counter() - t0
        if self.piecewise is not None and self.piecewise.eligible(ids.numel()):
            hidden = self.piecewise.run(ids, pos, ctx)  # [T, H]
        else:
            with forward_context(ctx):
                hidden = self.forward(ids, pos)  # [T, H]
        if not step.sample_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[rows])

    def _run_stage(self, step: StepInput) -> torch.Tensor | None:
        """One pipeline stage's part of a step, in micro-batches of whole sequences (one per stage, so
        the stages overlap): hidden states in from the previous stage (or the embedding), out to the next
        (or the LM head, whose logits the last stage's first rank sends to rank 0). Rank 0 returns the
        step's logits [N, V] in `sample_rows` order; other ranks return None."""
        from ferrylm.parallel.pipeline import split_step

        d, V = self.dist, self.model_config.vocab_size
        mbs = split_step(step, d.pp_size)
        pending, logits = [], []  # sends in flight (with their tensors), the last stage's logits
        for mb, (sub, _) in enumerate(mbs):
            ids, pos, ctx = self.tensors(sub)
            shape = (ids.numel(), self.model_config.hidden_size)
            x_in = None if d.first_stage else d.recv_prev(shape, self.dtype, self.device, mb)
            with forward_context(ctx):
                hidden = self.forward(ids, pos, x_in)  # [t, H]
            if not d.last_stage:
                hidden = hidden.contiguous()
                pending.append((d.send_next(hidden, mb), hidden))
            elif sub.sample_rows:
                out = self.model.compute_logits(hidden[to_device(sub.sample_rows, self.device)])
                logits.append(out)  # [n, V]
                if d.tp.rank == 0 and d.rank != 0:
                    pending.append((d.send_logits(out.contiguous(), mb), out))
        for work, _ in pending:
            work.wait()
        if d.rank != 0:
            return None
        if not d.last_stage:
            logits = [d.recv_logits((len(sub.sample_rows), V), self.device, mb)
                      for mb, (sub, _) in enumerate(mbs) if sub.sample_rows]
        out = torch.empty((len(step.sample_rows), V), dtype=torch.float32, device=self.device)
        for part, (_, where) in zip(logits, [m for m in mbs if m[0].sample_rows]):
            out[to_device(where, self.device)] = part
        return out
