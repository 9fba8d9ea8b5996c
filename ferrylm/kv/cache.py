"""The cache tensors: paged K/V blocks for every layer, and per-sequence state rows for models that keep
state that is not KV (Yuan2.0's filter inputs).

Which block or row belongs to which sequence is decided elsewhere (`kv/block_manager.py`,
`kv/state_pool.py`); this module only owns memory and the read/write primitives attention uses.
"""

from __future__ import annotations

import torch


class KVCache:
    """K and V for L layers, each [num_blocks + 1, block_size, kv_heads, head_dim] (V may be narrower:
    `v_head_dim`, 0 for MLA, whose K row is the compressed latent + rope key and holds the values too).

    The extra block at index `num_blocks` is scratch: padded rows of a CUDA-graph batch write there, and
    the block manager (which knows only `num_blocks`) never hands it out."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: batched decode reads whole blocks and masks the unwritten tail, and a masked
        # weight of 0 times a garbage NaN in recycled memory is still NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        # v_head_dim 0: no V (MLA reads its values from the cached latent in K)
        self.v = torch.zeros((*shape[:-1], head_dim if v_head_dim is None else v_head_dim), dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, v_head_dim: int | None = None) -> int:
        per_token = num_kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim))
        return num_layers * block_size * per_token * torch.tensor([], dtype=dtype).element_size()

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [T]; k, v: [T, Hk, D]
        self.k[i].view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(self.k.dtype))
        if v.shape[-1]:  # MLA passes no values: they live in the K row
            self.v[i].view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(self.v.dtype))


class SequenceStatePool:
    """Named per-sequence state tensors, each [num_slots, *shape]; a sequence owns one row of each."""

    def __init__(self, num_slots: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device | str):
        self.num_slots = num_slots
        self.tensors = {name: torch.zeros((num_slots, *shape), dtype=dt, device=device)
                        for name, (shape, dt) in specs.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Fork: the child gets its own copy of the parent's state, never a shared row."""
        for t in self.tensors.values():
            t[dst].copy_(t[src])
