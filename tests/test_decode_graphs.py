"""The CUDA-graph decode path on the CPU: everything but the capture (engine/cuda_graph.py runs the step a
graph would record, `_Uncaptured`, on the same static buffers, padding and context).

- Yuan's filter state through the graph inputs (`ForwardContext.state_rows`, padded rows on the pool's
  scratch row) against the host-list path on the same padded batch: exactly equal logits and state rows,
  step after step while sequences finish and join and state slots are reused; and within the usual
  tolerance of the plain unpadded eager step.
- Whole engines with `runner.graphs` on (the serving fill path, `ModelRunner._graph_step`), sync and async
  scheduling, against the eager engine and, for Yuan, against the golden logits of the HF reference.
fp32; each test prints its max difference. The same checks on a GPU, captured: tests/test_cuda.py -k graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from ferrylm import LLM, SamplingParams
from ferrylm.config import ModelConfig
from ferrylm.engine.cuda_graph import DecodeGraphs, _bucket
from ferrylm.engine.scheduler import SchedulerOutput
from ferrylm.engine.sequence import Sequence
from ferrylm.kv.cache import KVCache, SequenceStatePool
from ferrylm.layers.context import ForwardContext, forward_context
from ferrylm.models.yuan import YuanForCausalLM
from ferrylm.weights.source import SafetensorsSource

from helpers import capture_logits

DATA = os.path.join(os.path.dirname(__file__), "data")
TOL = 1e-4
GOLDEN = {"dense": "yuan2-tiny", "m32": "yuan2-m32-tiny"}
OPTS = {"dense": {}, "m32": {"rope_dtype": "bfloat16"}}  # M32: the reference's RoPE tables (test_yuan.py)


@pytest.fixture(scope="module")
def yuan_dirs(tmp_path_factory):
    """kind -> a model dir with only config.json + model.safetensors (the golden folders hold more)."""
    dirs = {}
    for kind, name in GOLDEN.items():
        d = tmp_path_factory.mktemp(name)
        for f in ("config.json", "model.safetensors"):
            os.symlink(os.path.join(DATA, name, f), d / f)
        dirs[kind] = str(d)
    return dirs


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- the model under three step descriptions --------------------------------------------------------------

class Side:
    """A KV cache and a dirty state pool (rows left by earlier owners), driven one way."""

    def __init__(self, model, way: str, num_slots: int, bs: int = 4, num_blocks: int = 48):
        cfg = model.config
        self.model, self.way, self.bs = model, way, bs
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim,
                          torch.float32, "cpu")
        self.pool = SequenceStatePool(num_slots, model.state_specs(), "cpu")
        for t in self.pool.tensors.values():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) * 3)
        self.graphs = DecodeGraphs(model.embed, self.body, self.kv, num_slots, 64, cfg.vocab_size,
                                   torch.device("cpu"), state=self.pool) if way == "graph" else None

    def body(self, x, pos):  # embeddings [B, H] -> logits [B, V]: the runner's eager layer loop
        step = self.model.begin_step(x.device)
        for i in range(self.model.num_layers):
            x = self.model.run_layer(i, pos, x, step)
        return self.model.compute_logits(self.model.final_norm(x))

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> torch.Tensor:
        """The whole prompt of a sequence starting at token 0, on the host-list path (every side alike)."""
        n, bs = len(seq.token_ids), self.bs
        slots = [seq.block_table[p // bs] * bs + p % bs for p in range(n)]
        ctx = ForwardContext(query_start_loc=[0, n], start_pos=[0], seq_lens=[n], slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor([seq.block_table]), num_decodes=0, kv_cache=self.kv,
                             state_slots=[seq.state_slot], state=self.pool)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(seq.token_ids), torch.arange(n))
        return self.model.compute_logits(hidden[-1:])[0]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for each sequence (its token at num_computed_tokens) -> logits [B, V]."""
        if self.way == "graph":
            return self.graphs.run(SchedulerOutput(seqs, [1] * len(seqs))).clone()
        B, bs = len(seqs), self.bs
        pos = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, pos)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        rows, lens = [s.state_slot for s in seqs], [p + 1 for p in pos]
        if self.way == "plain":  # the runner's eager step: exact lengths, no padding
            width = max(len(s.block_table) for s in seqs)
            tables, max_len, padded = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs], max(lens), False
        else:  # "padded": the graph's batch and context buckets, described by host lists
            Bb, g = _bucket(B, self.buckets.batch_buckets), self.kv.scratch_block
            nbb = _bucket((max(lens) + bs - 1) // bs, self.buckets.block_buckets)
            pad = Bb - B
            ids, pos, lens = ids + [0] * pad, pos + [0] * pad, lens + [1] * pad
            slots, rows = slots + [g * bs] * pad, rows + [self.pool.scratch_slot] * pad
            tables = [s.block_table[:nbb] + [g] * (nbb - len(s.block_table)) for s in seqs] + [[g] * nbb] * pad
            max_len, padded = nbb * bs, True
        ctx = ForwardContext(query_start_loc=list(range(len(ids) + 1)), start_pos=pos, seq_lens=lens,
                             slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables),
                             num_decodes=len(ids), kv_cache=self.kv, state_slots=rows, state=self.pool,
                             decode_seq_lens=torch.tensor(lens), decode_max_len=max_len, padded_decode=padded)
        with forward_context(ctx):
            return self.body(self.model.embed(torch.tensor(ids)), torch.tensor(pos))[:B]


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_yuan_graph_inputs_equal_host_lists_exactly(kind, yuan_dirs):
    """Batches of 3 (padded to 4) and 1, sequences finishing and joining between steps, a freed slot
    reused with its old owner's rows still in it, a 1-token prompt whose first step is a decode row."""
    src = SafetensorsSource(yuan_dirs[kind])
    model = YuanForCausalLM(ModelConfig.from_hf(src.config), **OPTS[kind]).eval()
    model.load_weights(src)
    num_slots = 4
    sides = {w: Side(model, w, num_slots) for w in ("plain", "padded", "graph")}
    sides["padded"].buckets = sides["graph"].graphs  # the same batch and context buckets
    assert sides["graph"].graphs.batch_buckets == [1, 2, 4]
    gen = torch.Generator().manual_seed(4)
    free_blocks = list(range(48))

    def new_seq(n_prompt: int, n_out: int, slot: int) -> dict[str, Sequence]:
        tokens = torch.randint(0, 380, (n_prompt + n_out,), generator=gen).tolist()
        table = [free_blocks.pop(0) for _ in range((len(tokens) + 3) // 4)]
        # one Sequence per side (each side's state advances on its own), all of the same tokens
        return {w: Sequence(tokens[:n_prompt], token_ids=tokens, block_table=table, state_slot=slot)
                for w in sides}

    worst_exact = worst_plain = 0.0
    steps_run = []

    def decode(batch: list[dict[str, Sequence]]):
        nonlocal worst_exact, worst_plain
        out = {w: s.decode([seq[w] for seq in batch]) for w, s in sides.items()}
        for seq in batch:
            for s in seq.values():
                s.num_computed_tokens += 1
        steps_run.append(len(batch))
        worst_exact = max(worst_exact, maxdiff(out["graph"], out["padded"]))
        worst_plain = max(worst_plain, maxdiff(out["graph"], out["plain"]))
        for name in ("lf_x", "lf_o1"):  # every owned row, after every step (the scratch row is anyone's)
            owned = torch.tensor([seq["graph"].state_slot for seq in batch])
            assert torch.equal(sides["graph"].pool[name][owned], sides["padded"].pool[name][owned])

    def prefill(seq: dict[str, Sequence], n_prompt: int):
        for w, s in sides.items():
            s.prefill(Sequence(seq[w].token_ids[:n_prompt], block_table=seq[w].block_table,
                               state_slot=seq[w].state_slot))
            seq[w].num_computed_tokens = n_prompt

    a, b, c = new_seq(7, 8, 0), new_seq(3, 4, 1), new_seq(11, 8, 2)
    for seq, n in ((a, 7), (b, 3), (c, 11)):
        prefill(seq, n)
    for _ in range(3):
        decode([a, b, c])  # 3 rows in the bucket of 4
    d = new_seq(5, 6, 1)  # b is done: d takes its slot, b's rows still in it
    prefill(d, 5)
    for _ in range(2):
        decode([a, c, d])
    e = new_seq(1, 4, 0)  # a is done: a 1-token prompt in a's slot, its first token a decode row at position 0
    decode([c, d, e])
    decode([d, e])
    decode([e])  # batch 1
    assert {1, 2, 3} <= set(steps_run) and sorted(sides["graph"].graphs.graphs)[0][0] == 1
    print(f"yuan {kind}: graph inputs vs padded host lists max |dlogit| = {worst_exact:.1e}; "
          f"vs plain eager {worst_plain:.1e} over {len(steps_run)} decode steps, buckets "
          f"{sorted(sides['graph'].graphs.graphs)}")
    assert worst_exact == 0.0
    assert worst_plain < TOL


# -- whole engines with the graph path on ---------------------------------------------------------------

def sampled(llm, prompts, steps, graphs: bool):
    if graphs:  # the serving path of a CUDA run (`_graph_step`), uncaptured
        llm.engine.runner.graphs = llm.engine.runner.decode_graphs()
    with capture_logits(llm.engine) as got:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in steps])
    rows: dict[int, list] = {}
    for sid, r in got:
        rows.setdefault(sid, []).append(r)
    return [o.outputs[0].token_ids for o in outs], [torch.stack(rows[s]) for s in sorted(rows)]


def graph_vs_eager(path: str, vocab: int, tag: str, preempt: bool = False, **kw) -> None:
    g = torch.Generator().manual_seed(3)
    # 6 requests through 4 slots: sequences finish and new ones join (reusing slots) between decode steps
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 1, 13, 3, 9, 6)]
    steps = [20, 6, 12, 3, 15, 9]
    opts = dict(dtype="float32", max_num_seqs=4, block_size=4, **kw)
    ref_ids, ref = sampled(LLM(path, **opts), prompts, steps, graphs=False)
    llm = LLM(path, **opts)
    ids, got = sampled(llm, prompts, steps, graphs=True)
    keys = sorted(llm.engine.runner.graphs.graphs)
    if preempt:  # recomputed sequences start again at token 0 in whatever slot is free
        assert llm.engine.scheduler.num_preemptions > 0
        tag += f", {llm.engine.scheduler.num_preemptions} preemptions"
    worst = max(maxdiff(a, b) for a, b in zip(ref, got))
    print(f"{tag}: graph path vs eager max |dlogit| = {worst:.1e}, buckets {keys}")
    if not preempt:  # batch and context buckets (a crowded pool runs few pure decode steps of one row)
        assert {k[0] for k in keys} >= {1, 4} and len({k[1] for k in keys}) >= 2
    assert ids == ref_ids
    assert worst < TOL


@pytest.mark.parametrize("kind,async_", [("dense", "off"), ("dense", "on"), ("m32", "off")])
def test_yuan_engine_graph_path_equals_eager(kind, async_, yuan_dirs):
    graph_vs_eager(yuan_dirs[kind], 380, f"yuan {kind} async={async_}", model_overrides=OPTS[kind],
                   async_scheduling=async_)


def test_yuan_engine_graph_path_chunked_and_preempted(yuan_dirs):
    """8-token chunks between graphed decode steps and a KV pool small enough to preempt."""
    graph_vs_eager(yuan_dirs["dense"], 380, "yuan dense chunked", preempt=True, max_num_batched_tokens=8,
                   num_kv_blocks=12)


def test_deepseek_engine_graph_path_equals_eager(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_models import DEEPSEEK, build

    path, _ = build(tmp_path_factory, "deepseek_v3-graph", *DEEPSEEK["deepseek_v3"])
    graph_vs_eager(path, 250, "deepseek_v3")


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_yuan_graph_path_matches_golden(kind, yuan_dirs):
    from safetensors.torch import load_file

    gd = load_file(os.path.join(DATA, GOLDEN[kind], "golden.safetensors"))
    llm = LLM(yuan_dirs[kind], dtype="float32", max_num_seqs=4, model_overrides=OPTS[kind])
    ids, (rows,) = sampled(llm, [gd["input_ids"][0].tolist()], [len(gd["greedy_ids"])], graphs=True)
    d = maxdiff(rows, gd["decode_logits"])
    print(f"yuan {kind}: graph path vs golden (HF reference) max |dlogit| = {d:.1e}")
    assert ids[0] == gd["greedy_ids"].tolist()
    assert d < TOL
