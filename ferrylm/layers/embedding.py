"""Token embeddings that may stay quantized, and LM heads (tied to them or their own).

`VocabEmbedding` is a `Linear` over the [V, H] table, so the loader hands it packed weights exactly as it
does a projection (`Linear.load`), and a tied LM head is the same module's matmul (`TiedLMHead`). A lookup
decodes only the rows it gathers; the LM head runs on the kernel `Linear` built for the table.

The CPU kernels return bf16, whose step near a logit of 16 is 0.06: close candidates would tie or swap. So
a packed LM head in an fp32 model recomputes its `REFINE_TOP` highest logits exactly (fp32, from the
dequantized rows): greedy picks and the head of the distribution are fp32-exact, the tail keeps bf16
rounding. It knows nothing about checkpoints or which family uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.layers.linear import Linear
from ferrylm.layers.qmatmul import QuantKernel
from ferrylm.weights.quant import QuantizedTensor

REFINE_TOP = 64
"""Logits per row recomputed in fp32 after a packed LM head's bf16 kernel."""


def refine_top(logits: torch.Tensor, hidden: torch.Tensor, qt: QuantizedTensor | QuantKernel) -> torch.Tensor:
    """Recompute the `REFINE_TOP` largest logits of each row exactly from `qt`'s rows (fp32)."""
    # logits: [N, V]; hidden: [N, H]
    top = logits.topk(min(REFINE_TOP, logits.shape[-1]), dim=-1).indices  # [N, R]
    rows = qt.rows(top.flatten()).dequantize(torch.float32).view(*top.shape, -1)  # [N, R, H]
    exact = torch.bmm(rows, hidden.float()[:, :, None])[..., 0]  # [N, R]
    return logits.scatter_(-1, top, exact.to(logits.dtype))


def _logits(head: Linear, hidden: torch.Tensor) -> torch.Tensor:
    out = Linear.forward(head, hidden)
    if len(head.kernels) == 1 and out.dtype == torch.float32 and head.kernels[0].row_wise:
        out = refine_top(out, hidden, head.kernels[0])
    return out


class VocabEmbedding(Linear):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(hidden_size, vocab_size)  # weight: [V, H], as nn.Embedding keeps it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        if self.kernels:
            return self.kernels[0].rows(input_ids).dequantize(self.weight.dtype)
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V]
        return _logits(self, hidden)


class LMHead(Linear):
    """An untied LM head: a `Linear` whose packed form gets the exact top-logit pass."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _logits(self, hidden)


class TiedLMHead(nn.Module):
    """The LM head of a tied model: the embedding table's matmul. Holds the embedding without registering
    it, so its parameters are listed (and loaded) once, under the embedding's name."""

    def __init__(self, embedding: VocabEmbedding):
        super().__init__()
        self._embedding = (embedding,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._embedding[0].logits(hidden)


class ParallelVocabEmbedding(VocabEmbedding):
    """The table split by vocabulary rows over the TP group: rank r holds ids [r n, (r+1) n) with
    n = ceil(V / ranks) (the last rank's tail rows are zero padding). A lookup embeds the ids it holds,
    zeros the others, and sums over the group; its logits are gathered (padding cut off). With a group of
    size 1 it is `VocabEmbedding`."""

    packed_slice = False
    """A rank's lookup reads its rows of the dense table (`forward`): its slice of a packed table is read dense."""

    def __init__(self, vocab_size: int, hidden_size: int):
        from ferrylm.parallel.group import current_group

        g = current_group()
        n = -(-vocab_size // g.size)  # ceil
        super().__init__(n if g.size > 1 else vocab_size, hidden_size)
        self.tp, self.vocab_size, self.first = g, vocab_size, g.rank * n

    def tp_part(self, attr: str, shard: str | None):
        if self.tp.size == 1:
            return None
        return (0, self.first, min(self.out_features, self.vocab_size - self.first))

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if self.tp.size > 1 and tensor.shape[0] < self.out_features:  # the last rank: pad with zero rows
            tensor = torch.cat([tensor, tensor.new_zeros(self.out_features - tensor.shape[0], *tensor.shape[1:])])
        super().load(name, tensor, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first  # [T]
        outside = (local < 0) | (local >= self.out_features)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] (each rank's [N, n] gathered)
        if self.tp.size == 1:
            return super().logits(hidden)
        return self.tp.all_gather_last(_logits(self, hidden))[:, :self.vocab_size]


class ParallelLMHead(ParallelVocabEmbedding):
    """An untied LM head split by vocabulary rows like the table (`ParallelVocabEmbedding`'s logits)."""

    packed_slice = True  # its logits go through the Linear's kernels

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)
