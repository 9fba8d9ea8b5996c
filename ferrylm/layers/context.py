"""ForwardContext: the per-step metadata that reaches attention (and other stateful layers).

The model runner builds one per step and installs it with `forward_context(ctx)` for the duration of
the forward pass; layers read it with `get_forward_context()`. Models never see requests or the
scheduler: this object is the whole interface between them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    # Notation: T = tokens in the step, B = sequences in the step.
    query_start_loc: list[int]
    """[B + 1] offsets of each sequence's tokens in the flat token batch."""
    start_pos: list[int]
    """[B] tokens of each sequence already in the cache before this step."""
    seq_lens: list[int]
    """[B] context length of each sequence after this step."""
    slot_mapping: torch.Tensor
    """[T] long: cache slot (block * block_size + offset) that receives each new token's K/V."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32 padded with 0."""
    num_decodes: int
    """The first `num_decodes` sequences compute exactly one token each (the scheduler orders them first)."""
    kv_cache: "object"
    """`kv.cache.KVCache` holding every layer's K/V blocks."""
    state_slots: list[int | None] = field(default_factory=list)
    """[B] row of each sequence in the per-sequence state pool (models with non-KV state)."""
    state: "object | None" = None
    """The per-sequence state tensors (`kv.cache.SequenceStatePool`), if the model has any."""
    state_rows: torch.Tensor | None = None
    """[B] long on the device: `state_slots` as a tensor, set by CUDA-graph decode (a pure decode step;
    padded rows name the pool's scratch row), so a stateful model indexes its state without host values."""
    decode_seq_lens: torch.Tensor | None = None
    """[num_decodes] long on the device, built once per step for the batched decode path."""
    decode_max_len: int = 0
    """max(decode_seq_lens), known on the host so no layer has to synchronise with the GPU to read it."""
    decode_groups: list[tuple[int, int, int]] | None = None
    """Decode rows attended together: (first row, end row, max context length). Bounds the transient
    [rows, max_len] K/V gather when one long sequence shares a step with many short ones. None: one group."""
    padded_decode: bool = False
    """decode_max_len is a bucket bound, not the exact max (CUDA graphs): attention must mask by length."""
    live_rows: torch.Tensor | None = None
    """[1] long on the device: how many rows of a padded decode step are real sequences (CUDA graphs write
    it before each replay, so a captured graph reads the step's count); None: every row is real."""

    _masks: dict = field(default_factory=dict, repr=False)
    _lens: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def prefill_mask(self, i: int, device, window: int | None = None) -> torch.Tensor:
        """[n, S] bool: sequence i's chunk query j (absolute position start + j) sees keys 0..start + j,
        or with a sliding window only start + j - window + 1..start + j. Built once per step and window,
        shared by every layer."""
        key = (i, window)
        if key not in self._masks:
            n, start = self.query_start_loc[i + 1] - self.query_start_loc[i], self.start_pos[i]
            mask = torch.ones(n, self.seq_lens[i], dtype=torch.bool, device=device).tril(diagonal=start)
            if window is not None:
                mask = mask.triu(diagonal=start - window + 1)
            self._masks[key] = mask
        return self._masks[key]


    def step_lens(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] long: each token's sequence length after this step (length-dependent RoPE). A decode
        row's is its position + 1, computed on the device (never cached: a decode graph's warm-up and
        capture share one context), so a captured decode graph stays valid."""
        if self.num_decodes == self.num_seqs:
            return positions + 1
        if self._lens is None:
            lens = positions + 1
            for i in range(self.num_decodes, self.num_seqs):
                lens[self.query_start_loc[i]:self.query_start_loc[i + 1]] = self.seq_lens[i]
            self._lens = lens
        return self._lens


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


_recording = True
_costliest = False


@contextlib.contextmanager
def recording_off():
    """Routing counts and the decode trace (`layers/moe.Experts`) record nothing meanwhile: a CUDA graph's
    warm-up run, which the replay that follows repeats as the step's real run."""
    global _recording
    prev, _recording = _recording, False
    try:
        yield
    finally:
        _recording = prev


def recording() -> bool:
    return _recording


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no ForwardContext installed: models run inside `forward_context(...)`")
    return _current


def live_rows() -> torch.Tensor | None:
    """The installed context's `live_rows` (None outside a padded graph step, or with no context)."""
    return None if _current is None else _current.live_rows


def live_assignments(topk_ids: torch.Tensor) -> torch.Tensor:
    """[T * k] ones for the assignments of real rows, zeros for a padded graph step's padding rows (whose
    token 0 routes too): the weights to count routing with. Device-side, graph-capturable."""
    live = live_rows()
    flat = topk_ids.flatten()
    if live is None:
        return torch.ones_like(flat)
    return (torch.arange(flat.numel(), device=flat.device) < live * topk_ids.shape[1]).to(flat.dtype)


@contextlib.contextmanager
def costliest_routing():
    """Every expert bank routes as the costliest prompt would for its memory (`layers/moe.costliest_ids`)
    meanwhile: the runner's warm-up step (`ModelRunner._warmup_peak`), whose measured peak sizes the KV pool, so
    no real prompt's routing takes more than it measured."""
    global _costliest
    prev, _costliest = _costliest, True
    try:
        yield
    finally:
        _costliest = prev


def costliest_routing_on() -> bool:
    return _costliest
