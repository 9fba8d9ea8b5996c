"""CUDA graphs for decode steps: one replay instead of ~30 kernel launches per layer.

A decode step of B sequences is padded to a batch bucket (1, 2, 4, ... up to max_num_seqs) and its
context to a block bucket (a power of two of KV blocks), and runs a graph captured for that pair on first
use. Inputs live in static buffers that each step overwrites; padded rows read and write a scratch block
the block manager never hands out, and a model with per-sequence state (Yuan's filter) gets its rows as a
static buffer too, padded rows on the state pool's scratch row. Prefill, mixed steps and models whose
forward reads host values (MoE dispatch counts of a host-reading expert backend) run eagerly: the eager
path is the reference the graph path is tested against (`tests/test_cuda.py`).

Off CUDA a "graph" is the callable a capture would record, run as it is (`_Uncaptured`): the same static
buffers, padding and context, so the CPU suite checks everything about the graph path but the capture
(`tests/test_decode_graphs.py`).
"""

from __future__ import annotations

import torch

from ferrylm.engine.scheduler import SchedulerOutput
from ferrylm.layers.context import ForwardContext, forward_context, recording_off


def side_stream(stream, device: torch.device):
    """`stream`, or a new one the first time: one side stream for every warm-up and capture of a graph set.
    cuBLAS keeps a workspace (32 MiB on Hopper and later) for each (thread, stream) that ran a GEMM, allocated
    through torch's allocator and never freed: a fresh pooled stream per capture (torch hands out 32 in turn)
    left up to 32 of them, a gigabyte, all allocated after the warm-up that sizes the KV pool measured it."""
    return stream if stream is not None else torch.cuda.Stream(device)


def _bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


class _Uncaptured:
    """Off CUDA: `replay()` runs the step a graph would have captured, reading the same static buffers."""

    def __init__(self, step):
        self.step = step

    @torch.inference_mode()
    def replay(self) -> None:
        self.step()


class DecodeGraphs:
    """`body(embed(ids), pos) -> logits` is the runner's eager step, captured as it is. An embedding table
    on the host (offloaded) is looked up before the replay into a static [B, H] buffer the graph reads."""

    def __init__(self, embed, body, kv_cache, max_num_seqs: int, max_model_len: int, vocab_size: int,
                 device: torch.device, embed_in_graph: bool = True, hidden_size: int = 0,
                 dtype: torch.dtype = torch.float32, state=None):
        self.embed, self.body, self.kv, self.device = embed, body, kv_cache, device
        self.state = state  # kv.cache.SequenceStatePool of a model with per-sequence state, or None
        self.embed_in_graph = embed_in_graph
        self.bs = kv_cache.block_size
        self.batch_buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_num_seqs] + [max_num_seqs]
        max_blocks = (max_model_len + self.bs - 1) // self.bs
        self.block_buckets = sorted({min(max_blocks, 2 ** k) for k in range(2, 20) if 2 ** (k - 1) < max_blocks}
                                    | {max_blocks})
        B, nb = self.batch_buckets[-1], self.block_buckets[-1]
        self.ids = torch.zeros(B, dtype=torch.long, device=device)
        self.pos = torch.zeros(B, dtype=torch.long, device=device)
        self.slots = torch.zeros(B, dtype=torch.long, device=device)
        self.lens = torch.ones(B, dtype=torch.long, device=device)
        self.live = torch.ones(1, dtype=torch.long, device=device)  # real rows of the padded step (host experts skip the rest)
        self.tables = torch.zeros(B, nb, dtype=torch.long, device=device)
        self.state_rows = torch.zeros(B, dtype=torch.long, device=device)
        self.x = None if embed_in_graph else torch.zeros(B, hidden_size, dtype=dtype, device=device)
        # one logits buffer for every graph: per-graph outputs would cost [bucket, V] fp32 per (batch,
        # context) pair, gigabytes with a large vocabulary and many buckets
        self.logits = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.side = None  # the one stream every capture warms up and captures on (`side_stream`)

    def reset(self) -> None:
        """Drop the captured graphs (captured again on next use): after a change baked into captures, e.g.
        hybrid decode's column split (`offload/placed_weights.set_cpu_share`)."""
        self.graphs.clear()
        self.pool = None  # a fresh pool: capturing into one whose graphs are gone trips the allocator

    def eligible(self, out: SchedulerOutput) -> bool:
        # every row must also sample: a 1-token chunk in the middle of a prompt yields no logits
        return len(out.seqs) <= self.batch_buckets[-1] and all(
            n == 1 and out.samples(i) for i, n in enumerate(out.num_new_tokens))

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [B, V] for a pure decode step (every row samples)."""
        B = len(out.seqs)
        Bb = _bucket(B, self.batch_buckets)
        lens = [s.num_computed_tokens + 1 for s in out.seqs]
        nbb = _bucket((max(lens) + self.bs - 1) // self.bs, self.block_buckets)
        scratch = self.kv.scratch_block
        ids, pos, slots, tables = [], [], [], []
        rows = [s.state_slot or 0 for s in out.seqs]
        for s in out.seqs:
            p = s.num_computed_tokens
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // self.bs] * self.bs + p % self.bs)
            row = s.block_table[:nbb]
            tables.append(row + [scratch] * (nbb - len(row)))
        pad = Bb - B
        ids += [0] * pad
        pos += [0] * pad
        slots += [scratch * self.bs] * pad
        lens += [1] * pad
        tables += [[scratch] * nbb] * pad
        rows += [self.scratch_row] * pad
        # one host->device copy per buffer; the graph reads them in place
        self.ids[:Bb].copy_(torch.tensor(ids), non_blocking=True)
        self.pos[:Bb].copy_(torch.tensor(pos), non_blocking=True)
        self.slots[:Bb].copy_(torch.tensor(slots), non_blocking=True)
        self.lens[:Bb].copy_(torch.tensor(lens), non_blocking=True)
        self.tables[:Bb, :nbb].copy_(torch.tensor(tables), non_blocking=True)
        self.state_rows[:Bb].copy_(torch.tensor(rows), non_blocking=True)
        self.live.fill_(B)
        if not self.embed_in_graph:
            self.x[:Bb].copy_(self.embed(torch.tensor(ids)))
        graph, logits = self._graph(Bb, nbb)
        graph.replay()
        return logits[:B]

    @property
    def scratch_row(self) -> int:
        """The state row padded rows use (0 when the model has no state: the buffer is then never read)."""
        return self.state.scratch_slot if self.state is not None else 0

    def _context(self, Bb: int, nbb: int) -> ForwardContext:
        # host fields are placeholders every replay shares: a graphed model reads only the device tensors
        return ForwardContext(
            query_start_loc=list(range(Bb + 1)), start_pos=[0] * Bb, seq_lens=[1] * Bb,
            slot_mapping=self.slots[:Bb], block_tables=self.tables[:Bb, :nbb], num_decodes=Bb,
            kv_cache=self.kv, state=self.state, state_rows=self.state_rows[:Bb] if self.state is not None else None,
            decode_seq_lens=self.lens[:Bb], decode_max_len=nbb * self.bs, padded_decode=True,
            live_rows=self.live)

    def _step(self, Bb: int, nbb: int):
        """The callable a graph of bucket (Bb, nbb) records: static buffers in, `self.logits[:Bb]` out."""
        ctx, logits = self._context(Bb, nbb), self.logits[:Bb]
        ids, pos = self.ids[:Bb], self.pos[:Bb]
        embed, body, x_in = self.embed, self.body, None if self.embed_in_graph else self.x[:Bb]

        def step():  # no reference to self: off CUDA `graphs` keeps it, and a cycle would hold the KV pool
            with forward_context(ctx):
                x = embed(ids) if x_in is None else x_in
                logits.copy_(body(x, pos))
        return step, logits

    def _warm_up(self, step, Bb: int) -> None:
        """Run the step once before its capture (lazy tables, allocator, kernels), on the inputs of the step
        about to replay. Its K/V writes are the replay's own; its filter state writes are not (the replay
        would read this step's rows as the previous token's), so they go to the scratch row meanwhile."""
        rows = self.state_rows[:Bb]
        real = rows.clone()
        rows.fill_(self.scratch_row)
        with recording_off():  # the replay that follows is the step's run
            step()
        rows.copy_(real)

    @torch.inference_mode()
    def _graph(self, Bb: int, nbb: int):
        key = (Bb, nbb)
        if key in self.graphs:
            return self.graphs[key]
        step, logits = self._step(Bb, nbb)
        if self.device.type != "cuda":
            self._warm_up(step, Bb)
            self.graphs[key] = (_Uncaptured(step), logits)
            return self.graphs[key]
        stream = self.side = side_stream(self.side, self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up(step, Bb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            step()
        self.pool = graph.pool()
        self.graphs[key] = (graph, logits)
        return self.graphs[key]


class PiecewiseGraphs:
    """Prefill and mixed steps: each layer's `pre` (norm, qkv, rope) and `post` (o_proj, residual, MLP)
    replayed as graphs captured per token-count bucket; attention, whose work depends on every sequence's
    length, runs eagerly between them. One graph holds the embedding and layer 0's `pre`, the next layer
    i's `post` and layer i+1's `pre`, the last the final norm: L + 1 replays a step instead of ~30 launches
    a layer. Padded rows carry token 0 at position 0; attention never sees them (it gets the first T rows).
    """

    def __init__(self, model, max_num_batched_tokens: int, dtype: torch.dtype, device: torch.device):
        self.model, self.device = model, device  # a CausalLM with `piecewise` segments
        top = max_num_batched_tokens
        self.buckets = [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if b < top] + [top]
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.attn_out = torch.zeros(top, model.attn_width, dtype=dtype, device=device)
        self.live = torch.zeros(1, dtype=torch.long, device=device)
        """Real tokens of the padded step, written before the replays: the pieces are captured under a context
        whose `live_rows` it is, so routing counts leave the padding rows out (`context.live_assignments`)."""
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, tuple]]] = {}
        self.pool = None
        self.side = None  # the one stream every capture warms up and captures on (`side_stream`)

    def reset(self) -> None:
        """Drop the captured pieces (captured again on next use), as `DecodeGraphs.reset`."""
        self.graphs.clear()
        self.pool = None

    def eligible(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def run(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """ids, pos: [T] -> final hidden states [T, H] (the same function as `model(ids, pos)`)."""
        T = ids.numel()
        Tb = _bucket(T, self.buckets)
        self.ids[:T].copy_(ids)
        self.ids[T:Tb].zero_()
        self.pos[:T].copy_(pos)
        self.pos[T:Tb].zero_()
        self.live.fill_(T)
        segs = self._graphs(Tb)
        segs[0][0].replay()
        with forward_context(ctx):
            for i in range(self.model.num_layers):
                _, q, k, v = segs[i][1]
                self.attn_out[:T].copy_(self.model.layer_attention(i, q[:T], k[:T], v[:T]))
                segs[i + 1][0].replay()
        return segs[-1][1][0][:T]

    @torch.inference_mode()
    def _graphs(self, Tb: int):
        if Tb in self.graphs:
            return self.graphs[Tb]
        ids, pos, a = self.ids[:Tb], self.pos[:Tb], self.attn_out[:Tb]
        model, L = self.model, self.model.num_layers
        segs: list[tuple[torch.cuda.CUDAGraph, tuple]] = []

        def piece(i: int):
            if i == 0:
                x = model.embed(ids)  # [Tb, H]
                return (x, *model.layer_pre(0, pos, x))
            x = model.layer_post(i - 1, segs[i - 1][1][0], a)
            return (x, *model.layer_pre(i, pos, x)) if i < L else (model.final_norm(x),)

        # the pieces see no attention metadata; only the padded rows' count, for routing counts
        ctx = ForwardContext([], [], [], torch.empty(0), torch.empty(0), 0, None, live_rows=self.live)
        for i in range(L + 1):
            stream = self.side = side_stream(self.side, self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), recording_off():  # warm-up: allocator and library handles, uncaptured
                piece(i)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream), forward_context(ctx):
                outs = piece(i)
            self.pool = graph.pool()
            segs.append((graph, outs))
        self.graphs[Tb] = segs
        return segs
