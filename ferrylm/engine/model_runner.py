"""ModelRunner: owns the model module and the cache tensors on one device, and turns a
`SchedulerOutput` into batch tensors, runs the forward pass and returns the logits to sample.

It knows devices, dtypes and tensors; it knows nothing about requests, tokenizers or sampling policy.
Notation: T tokens in the step, B sequences, N sequences that sample this step, V vocabulary.
"""

from __future__ import annotations

import logging

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.engine.scheduler import SchedulerOutput
from ferrylm.errors import ConfigError
from ferrylm.kv.cache import KVCache, SequenceStatePool
from ferrylm.layers.context import ForwardContext, forward_context
from ferrylm.layers.rotary import RotaryEmbedding
from ferrylm.models.registry import model_class

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


class ModelRunner:
    decode_gather_tokens = 1 << 16
    """Decode attention gathers each group's K/V into [rows, max_len]: this caps rows x max_len."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, source, max_model_len: int,
                 progress=None):
        self.config, self.model_config = config, model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.block_size = config.cache.block_size
        cls = model_class(model_config)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = cls(model_config, **config.model_overrides)
        except TypeError as e:
            if not config.model_overrides:
                raise
            raise ConfigError(f"model option(s) {sorted(config.model_overrides)} not accepted by "
                              f"{cls.__name__}: {e}") from None
        finally:
            torch.set_default_dtype(prev)
        self.model.eval()
        self.model.load_weights(source, progress=progress)
        for m in self.model.modules():  # RoPE tables before the KV cache takes the free memory, and only
            if isinstance(m, RotaryEmbedding):  # as long as the engine's context (128k-position models)
                m.max_positions = min(m.max_positions, max_model_len)
                m._table(self.device)
        self.kv_cache = self._allocate_kv(max_model_len)
        self.state_pool = self._allocate_state()
        self.graphs = self.piecewise = None
        if self.device.type == "cuda" and not config.enforce_eager and self.model.cuda_graphs:
            from ferrylm.engine.cuda_graph import DecodeGraphs, PiecewiseGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_cache, config.scheduler.max_num_seqs, max_model_len,
                                       model_config.vocab_size, self.device)
            self.piecewise = PiecewiseGraphs(self.model, config.scheduler.max_num_batched_tokens, self.device)

    # -- memory -----------------------------------------------------------------------------------

    def _allocate_kv(self, max_model_len: int) -> KVCache:
        cfg, cc = self.model_config, self.config.cache
        per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads,
                                            cfg.head_dim, self.dtype)
        if cc.num_blocks is not None:
            num_blocks = cc.num_blocks
        elif cc.memory_gb is not None:
            num_blocks = int(cc.memory_gb * 2**30 // per_block)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = int(0.85 * free // per_block)
        else:  # enough for every sequence at full length, capped at 2 GiB of host memory
            need = self.config.scheduler.max_num_seqs * ((max_model_len + self.block_size - 1) // self.block_size)
            num_blocks = min(need, int(2 * 2**30 // per_block))
        if num_blocks < 2:
            raise ConfigError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size, num_blocks * per_block / 2**30)
        return KVCache(cfg.num_hidden_layers, num_blocks, self.block_size, cfg.num_key_value_heads,
                       cfg.head_dim, self.dtype, self.device)

    def _allocate_state(self) -> SequenceStatePool | None:
        specs = self.model.state_specs() if hasattr(self.model, "state_specs") else None
        if not specs:
            return None
        return SequenceStatePool(self.config.scheduler.max_num_seqs, specs, self.device)

    # -- one step ---------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, starts, lens, sample_rows = [0], [], [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
            starts.append(start)
            lens.append(start + n)
            if out.samples(i):
                sample_rows.append(qsl[-1] - 1)
        num_decodes = 0
        while num_decodes < len(out.seqs) and out.num_new_tokens[num_decodes] == 1:
            num_decodes += 1
        width = max(len(s.block_table) for s in out.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in out.seqs]
        dev = self.device
        ctx = ForwardContext(
            query_start_loc=qsl, start_pos=starts, seq_lens=lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            num_decodes=num_decodes, kv_cache=self.kv_cache,
            state_slots=[s.state_slot for s in out.seqs], state=self.state_pool,
            decode_seq_lens=torch.tensor(lens[:num_decodes], dtype=torch.long, device=dev) if num_decodes else None,
            decode_max_len=max(lens[:num_decodes], default=0),
            decode_groups=decode_groups(lens[:num_decodes], self.decode_gather_tokens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, ctx, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns logits [N, V] (fp32) for the sequences with `out.samples(i)`, in order."""
        if self.graphs is not None and self.graphs.eligible(out):
            return self.graphs.run(out)
        ids, pos, ctx, sample_rows = self.prepare(out)
        if self.piecewise is not None and self.piecewise.eligible(ids.numel()):
            hidden = self.piecewise.run(ids, pos, ctx)  # [T, H]
        else:
            with forward_context(ctx):
                hidden = self.model(ids, pos)  # [T, H]
        if not sample_rows:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])
