"""Yuan2.0 (dense) and Yuan2.0-M32 against the golden logits of the reference HF code, in fp32 on the CPU.

Golden data: tests/data/yuan2-tiny and tests/data/yuan2-m32-tiny (their README.md states the reference
semantics). Two tiers:
- the model driven directly under hand-built `ForwardContext`s (`Driver`, the model runner's `prepare()`
  in miniature with its own toy scheduler): prefill, teacher-forced decode, chunked prefill, mixed batches,
  preemption with dirty state rows. These need nothing of the engine but the KV cache and state pool.
- the same checks end to end through `LLM.generate` (greedy ids and every sampled logits row).
Tolerance 1e-4 on logits everywhere; each test prints its max difference.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrylm.config import ModelConfig
from ferrylm.kv.cache import KVCache, SequenceStatePool
from ferrylm.layers.context import ForwardContext, forward_context
from ferrylm.models.yuan import YuanForCausalLM
from ferrylm.plan import yuan_sizes
from ferrylm.weights.source import SafetensorsSource

DATA = os.path.join(os.path.dirname(__file__), "data")
TOL = 1e-4
BF16 = {"rope_dtype": "bfloat16"}  # the M32 reference's RoPE tables


# -- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """name -> a model dir holding only config.json + model.safetensors: a weight source reads every
    *.safetensors of a directory, and the golden folders also hold golden.safetensors."""
    dirs = {}
    for name in ("yuan2-tiny", "yuan2-m32-tiny"):
        d = tmp_path_factory.mktemp(name)
        for f in ("config.json", "model.safetensors"):
            os.symlink(os.path.join(DATA, name, f), d / f)
        dirs[name] = str(d)
    return dirs


@pytest.fixture(scope="module")
def golden():
    return {name: load_file(os.path.join(DATA, name, "golden.safetensors")) for name in ("yuan2-tiny", "yuan2-m32-tiny")}


def load_model(path: str, **overrides) -> YuanForCausalLM:
    src = SafetensorsSource(path)
    model = YuanForCausalLM(ModelConfig.from_hf(src.config), **overrides).eval()
    model.load_weights(src)
    return model


@pytest.fixture(scope="module")
def models(model_dirs):
    """(golden name, option label) -> model; M32 runs with the reference's bf16 RoPE tables unless noted."""
    return {
        "dense": load_model(model_dirs["yuan2-tiny"]),
        "m32": load_model(model_dirs["yuan2-m32-tiny"], **BF16),
        "m32-fp32rope": load_model(model_dirs["yuan2-m32-tiny"]),
    }


GOLDEN_OF = {"dense": "yuan2-tiny", "m32": "yuan2-m32-tiny"}


# -- a direct driver: the model runner's prepare() with a toy scheduler ---------------------------------

class Driver:
    """Owns a KV cache and a state pool and runs the model on hand-made steps, as the model runner does.

    A step is a list of (seq key, all token ids, start, n, state slot); decodes (n == 1) must come first.
    """

    def __init__(self, model: YuanForCausalLM, num_blocks: int = 64, block_size: int = 4, num_slots: int = 4,
                 dirty: bool = True):
        cfg = model.config
        self.model, self.bs = model, block_size
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                          torch.float32, "cpu")
        self.pool = SequenceStatePool(num_slots, model.state_specs(), "cpu")
        if dirty:  # rows left over from earlier owners: a model that trusts them fails every test
            for t in self.pool.tensors.values():
                t.normal_(0, 3.0)
        self.free = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def drop(self, key: str) -> None:
        self.free += self.tables.pop(key, [])

    @torch.inference_mode()
    def step(self, work) -> torch.Tensor:
        """Returns the logits of each entry's last token: [B, V]."""
        ids, pos, slots, qsl, starts, lens, tables = [], [], [], [0], [], [], []
        for key, tokens, start, n, _ in work:
            table = self.tables.setdefault(key, [])
            while len(table) * self.bs < start + n:
                table.append(self.free.pop(0))
            ids += tokens[start:start + n]
            pos += range(start, start + n)
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
            starts.append(start)
            lens.append(start + n)
            tables.append(table)
        nd = 0
        while nd < len(work) and work[nd][3] == 1:
            nd += 1
        width = max(len(t) for t in tables)
        ctx = ForwardContext(
            query_start_loc=qsl, start_pos=starts, seq_lens=lens, slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]), num_decodes=nd,
            kv_cache=self.kv, state_slots=[w[4] for w in work], state=self.pool,
            decode_seq_lens=torch.tensor(lens[:nd]) if nd else None, decode_max_len=max(lens[:nd], default=0))
        with forward_context(ctx):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
        return self.model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])


def run_forced(model, seqs: dict[str, tuple[list[int], int]], budget: int = 10**6, preempt: dict | None = None,
               num_slots: int = 4) -> dict[str, dict[int, torch.Tensor]]:
    """Teacher-forced generation under a toy continuous-batching scheduler.

    seqs: key -> (prompt + forced outputs, prompt length). Each step computes decodes first, then prefill
    chunks within `budget` tokens; a sequence's output i is revealed once the logits for it are taken.
    preempt: step number -> keys, dropped in that order at that step (KV and state slot freed, put at the
    front of the queue, recomputed from token 0 into whatever slot is free then). Returns key -> {position whose logits were sampled: logits [V]}.
    """
    drv = Driver(model, num_slots=num_slots)
    preempt = preempt or {}
    visible = {k: p for k, (_, p) in seqs.items()}
    computed = dict.fromkeys(seqs, 0)
    slot: dict[str, int | None] = dict.fromkeys(seqs)
    free_slots = list(range(num_slots))
    waiting, running = list(seqs), []
    got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in seqs}
    step = 0
    while waiting or running:
        for k in preempt.get(step, ()):
            if k not in running:
                continue
            running.remove(k)
            drv.drop(k)
            free_slots.append(slot[k])
            slot[k], computed[k] = None, 0
            waiting.insert(0, k)
        while waiting and free_slots:  # admit FIFO, a slot each (lowest first, like the state slot pool)
            k = waiting.pop(0)
            free_slots.sort()
            slot[k] = free_slots.pop(0)
            running.append(k)
        left, work = budget, []
        for k in sorted(running, key=lambda k: visible[k] - computed[k] != 1):  # decodes first
            n = min(visible[k] - computed[k], left)
            if n > 0:
                work.append((k, seqs[k][0], computed[k], n, slot[k]))
                left -= n
        logits = drv.step(work)
        for (k, tokens, start, n, _), row in zip(work, logits):
            computed[k] += n
            if computed[k] == visible[k]:  # sampled: record, then reveal the forced next token
                pos = visible[k] - 1
                if pos in got[k]:  # recomputed after preemption: must reproduce what it produced before
                    assert (got[k][pos] - row).abs().max() < TOL, f"{k}: recompute of position {pos} differs"
                got[k][pos] = row.clone()
                if visible[k] < len(tokens):
                    visible[k] += 1
                else:
                    running.remove(k)
                    drv.drop(k)
                    free_slots.append(slot[k])
        step += 1
    return got


@torch.inference_mode()
def prefill_all(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh prefill keeping every row: hidden [T, H], logits [T, V]."""
    drv, T = Driver(model), len(ids)
    ctx = ForwardContext(query_start_loc=[0, T], start_pos=[0], seq_lens=[T], slot_mapping=torch.arange(T),
                         block_tables=torch.arange((T + drv.bs - 1) // drv.bs)[None], num_decodes=0,
                         kv_cache=drv.kv, state_slots=[0], state=drv.pool)
    with forward_context(ctx):
        hidden = model(torch.tensor(ids), torch.arange(T))
    return hidden, model.compute_logits(hidden)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def forced(g: dict, tag: str = "") -> tuple[list[int], int, torch.Tensor]:
    """Prompt + greedy ids as one teacher-forced sequence, its prompt length and the decode logits."""
    prompt = g[f"input_ids{tag}"][0].tolist()
    return prompt + g[f"greedy_ids{tag}"].tolist(), len(prompt), g[f"decode_logits{tag}"]


# -- golden: prefill, decode, special prompts -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_prefill_matches_golden(kind, models, golden):
    g, model = golden[GOLDEN_OF[kind]], models[kind]
    for tag in ("", "_1tok"):
        hidden, logits = prefill_all(model, g[f"input_ids{tag}"][0].tolist())
        d = maxdiff(logits, g[f"logits_prefill{tag}"][0])
        print(f"{kind}{tag}: prefill max |dlogit| = {d:.2e}")
        assert d < TOL
        if not tag:
            dh = maxdiff(hidden, g["hidden_states_prefill"][2])
            print(f"{kind}: final hidden max diff = {dh:.2e}")
            assert dh < TOL


@pytest.mark.parametrize("kind", ["dense", "m32"])
@pytest.mark.parametrize("tag", ["", "_1tok"])
def test_decode_teacher_forced_matches_golden(kind, tag, models, golden):
    g = golden[GOLDEN_OF[kind]]
    tokens, plen, ref = forced(g, tag)
    got = run_forced(models[kind], {"a": (tokens[:-1], plen)})["a"]
    ours = torch.stack([got[plen - 1 + i] for i in range(len(ref))])  # [steps, V]
    steps = [maxdiff(ours[i], ref[i]) for i in range(len(ref))]
    print(f"{kind}{tag}: decode max |dlogit| per step = {' '.join(f'{d:.1e}' for d in steps)}")
    assert max(steps) < TOL
    assert ours.argmax(-1).tolist() == g[f"greedy_ids{tag}"].tolist()


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_chunked_prefill_matches_full_forward(kind, models, golden):
    """full_ids (36 tokens) in chunks of 5: every chunk's last row equals the uncached reference forward."""
    g = golden[GOLDEN_OF[kind]]
    ids = g["full_ids"][0].tolist()
    drv = Driver(models[kind])
    worst = 0.0
    for start in range(0, len(ids), 5):
        n = min(5, len(ids) - start)
        row = drv.step([("a", ids, start, n, 1)])[0]
        worst = max(worst, maxdiff(row, g["logits_full"][0, start + n - 1]))
    print(f"{kind}: chunked prefill (5) vs logits_full max |dlogit| = {worst:.2e}")
    assert worst < TOL


def test_eod_prompt_follows_plain_causal_attention(models, golden):
    """We serve the flash path's plain causal attention (no eod reset): `logits_prefill_eod_noreset`."""
    g = golden["yuan2-tiny"]
    ids = g["input_ids_eod"][0].tolist()
    _, ours = prefill_all(models["dense"], ids)
    got = run_forced(models["dense"], {"a": (ids, 1)})["a"]  # decoded token by token: eods arrive as decodes
    d = max(maxdiff(ours, g["logits_prefill_eod_noreset"][0]),
            maxdiff(torch.stack([got[i] for i in range(len(ids))]), g["logits_prefill_eod_noreset"][0]))
    d_reset = maxdiff(ours, g["logits_prefill_eod"][0])
    print(f"dense eod: vs no-reset golden {d:.2e}; vs eager eod-reset golden {d_reset:.2f} (not served)")
    assert d < TOL
    assert d_reset > 1.0  # the data tells the two behaviours apart

    g = golden["yuan2-m32-tiny"]  # M32's config does not reset at eod: one golden, plain causal
    _, ours = prefill_all(models["m32"], g["input_ids_eod"][0].tolist())
    d = maxdiff(ours, g["logits_prefill_eod"][0])
    print(f"m32 eod: max |dlogit| = {d:.2e}")
    assert d < TOL


# -- M32 specifics ----------------------------------------------------------------------------------------

def test_m32_router_logits_and_experts(models, golden):
    g, model = golden["yuan2-m32-tiny"], models["m32"]
    caught = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append(o.clone()))
             for layer in model.model.layers]
    try:
        ids = g["full_ids"][0].tolist()
        run_forced(model, {"a": (ids, len(ids))})
    finally:
        for h in hooks:
            h.remove()
    ours = torch.stack(caught)  # [L, 36, E]
    ref = g["router_logits_full"]
    d = maxdiff(ours, ref)
    print(f"m32 router logits max diff = {d:.2e}")
    assert ours.dtype == torch.float32 and d < TOL
    assert torch.equal(ours.topk(2, -1).indices.sort(-1).values, ref.topk(2, -1).indices.sort(-1).values)


def test_m32_rope_tables(models, golden):
    """bf16 option: the reference tables bit for bit. fp32 default: runs, differs from the bf16 golden."""
    g = golden["yuan2-m32-tiny"]
    cs = models["m32"].model.layers[0].self_attn.rotary._table(torch.device("cpu"))  # [P, 2, rot]
    assert torch.equal(cs[:256, 0], g["rope_cos_cached"]) and torch.equal(cs[:256, 1], g["rope_sin_cached"])
    fp32 = models["m32-fp32rope"]
    assert fp32.rope_dtype == torch.float32  # the default
    tokens, plen, ref = forced(g)
    got = run_forced(fp32, {"a": (tokens[:-1], plen)})["a"]
    ours = torch.stack([got[plen - 1 + i] for i in range(len(ref))])
    d = maxdiff(ours, ref)
    print(f"m32 fp32 RoPE vs bf16-table golden: max |dlogit| = {d:.2f} (expected: the tables differ)")
    assert torch.isfinite(ours).all() and d > 1e-3
    dense_cs = models["dense"].model.layers[0].self_attn.rotary._table(torch.device("cpu"))
    assert maxdiff(dense_cs[:256, 0], golden["yuan2-tiny"]["rope_cos_cached"]) < 1e-6


# -- state isolation: mixed batches, chunked prefill, preemption -----------------------------------------

def _mixed_seqs(g: dict) -> dict[str, tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(7)
    other = lambda n: torch.randint(0, 380, (n,), generator=gen).tolist()  # noqa: E731
    tokens, plen, _ = forced(g)
    return {"b": (other(11 + 6), 11), "a": (tokens[:-1], plen), "c": (other(5 + 9), 5), "d": (other(1 + 7), 1)}


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_state_isolation_mixed_chunked_preempted(kind, models, golden):
    g, model = golden[GOLDEN_OF[kind]], models[kind]
    seqs = _mixed_seqs(g)
    alone = {k: run_forced(model, {k: v})[k] for k, v in seqs.items()}
    # budget 8: prompts are chunked and share steps with decodes. "a" is preempted mid-prefill (back into
    # its own half-written slot), then mid-decode together with "c", so each recomputes in the other's
    # slot; "d" starts in the slot "b" finished in
    mixed = run_forced(model, seqs, budget=8, preempt={2: ["a"], 9: ["a", "c"]}, num_slots=3)
    worst = max(maxdiff(mixed[k][p], alone[k][p]) for k in seqs for p in alone[k])
    assert all(mixed[k].keys() == alone[k].keys() for k in seqs)
    _, plen, ref = forced(g)
    vs_golden = maxdiff(torch.stack([mixed["a"][plen - 1 + i] for i in range(len(ref))]), ref)
    print(f"{kind}: mixed/chunked/preempted vs alone max |dlogit| = {worst:.2e}; 'a' vs golden = {vs_golden:.2e}")
    assert worst < TOL and vs_golden < TOL


def test_state_is_not_read_at_sequence_start(models, golden):
    """A fresh sequence in a slot full of garbage gives the same logits as in a clean pool."""
    g, model = golden["yuan2-tiny"], models["dense"]
    ids = g["input_ids"][0].tolist()
    rows = []
    for dirty in (False, True):
        drv = Driver(model, dirty=dirty)
        rows.append(drv.step([("a", ids, 0, 10, 2)])[0])
        rows.append(drv.step([("a", ids, 10, 14, 2)])[0])
    assert maxdiff(rows[0], rows[2]) == 0 and maxdiff(rows[1], rows[3]) == 0
    assert maxdiff(rows[1], g["logits_prefill"][0, -1]) < TOL


# -- weights ----------------------------------------------------------------------------------------------

def test_loads_checkpoint_with_explicit_lm_head_and_inv_freq(model_dirs, golden, tmp_path):
    """Real Yuan2 .bin checkpoints carry lm_head.weight (a copy of the embeddings) and rotary inv_freq."""
    src = os.path.join(model_dirs["yuan2-tiny"], "model.safetensors")
    tensors = load_file(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    os.symlink(os.path.join(model_dirs["yuan2-tiny"], "config.json"), tmp_path / "config.json")
    model = load_model(str(tmp_path))
    g = golden["yuan2-tiny"]
    ids = g["input_ids"][0].tolist()
    row = Driver(model).step([("a", ids, 0, len(ids), 0)])[0]
    assert maxdiff(row, g["logits_prefill"][0, -1]) < TOL


# -- sizes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,total,active", [
    ("Yuan2-2B", 2.09e9, None), ("Yuan2-51B", 51.8e9, None), ("Yuan2-102B", 102.6e9, None),
    ("Yuan2-M32", 39.9e9, 3.7e9)])
def test_param_counts_match_published_totals(name, total, active):
    c = yuan_sizes.param_counts(yuan_sizes.REAL_CONFIGS[name])
    print(f"{name}: total {c.total / 1e9:.3f}B, active {c.active / 1e9:.3f}B")
    assert abs(c.total / total - 1) < 0.01
    assert abs(c.active / (active or total) - 1) < 0.01


def test_size_functions_match_the_built_models(models):
    for kind in ("dense", "m32"):
        model = models[kind]
        raw = model.config.raw
        n = sum(p.numel() for p in model.parameters())  # a tied lm_head is counted once
        assert yuan_sizes.param_counts(raw).total == n
        specs = model.state_specs()
        values = sum(torch.Size(shape).numel() for shape, _ in specs.values())
        assert values == yuan_sizes.lf_state_values(raw) == raw["num_hidden_layers"] * 1.5 * raw["hidden_size"]
        assert yuan_sizes.lf_state_bytes(raw, 4) == values * 4
        assert yuan_sizes.kv_bytes_per_token(raw, 4) == 2 * model.config.num_hidden_layers * \
            model.config.num_key_value_heads * model.config.head_dim * 4
    assert yuan_sizes.lf_state_bytes(yuan_sizes.YUAN2_2B) == 24 * 3072 * 2


# -- end to end through LLM.generate ----------------------------------------------------------------------

def _llm(path, **kw):
    from ferrylm import LLM

    return LLM(path, dtype="float32", **kw)


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_llm_greedy_matches_golden(kind, model_dirs, golden):
    from ferrylm import SamplingParams
    from helpers import capture_logits

    g = golden[GOLDEN_OF[kind]]
    llm = _llm(model_dirs[GOLDEN_OF[kind]], max_num_seqs=4, model_overrides=BF16 if kind == "m32" else {})
    for tag in ("", "_1tok"):
        ref_ids, ref = g[f"greedy_ids{tag}"].tolist(), g[f"decode_logits{tag}"]
        with capture_logits(llm.engine) as got:
            out = llm.generate([g[f"input_ids{tag}"][0].tolist()],
                               SamplingParams(temperature=0, max_tokens=len(ref_ids), ignore_eos=True))
        d = maxdiff(torch.stack([row for _, row in got]), ref)
        print(f"LLM {kind}{tag}: greedy max |dlogit| = {d:.2e}")
        assert out[0].outputs[0].token_ids == ref_ids
        assert d < TOL
    # n = 2: two sequences of one request, each with its own filter state row
    out = llm.generate([g["input_ids"][0].tolist()], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in out[0].outputs] == [g["greedy_ids"].tolist()] * 2


@pytest.mark.parametrize("kind", ["dense", "m32"])
def test_llm_state_isolation_chunked_preempted(kind, model_dirs, golden):
    """A Yuan sequence batched with others of different lengths, chunked prefill (8 tokens a step) and a KV
    pool small enough to force preemption gives the logits it gives alone."""
    from ferrylm import SamplingParams
    from helpers import capture_logits

    g = golden[GOLDEN_OF[kind]]
    opts = BF16 if kind == "m32" else {}
    gen = torch.Generator().manual_seed(11)
    prompts = [g["input_ids"][0].tolist()] + [torch.randint(0, 380, (n,), generator=gen).tolist() for n in (13, 3, 7)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm, ps):
        with capture_logits(llm.engine) as got:
            outs = llm.generate(ps, params)
        return outs, got

    alone = []
    for p in prompts:
        outs, got = run(_llm(model_dirs[GOLDEN_OF[kind]], max_num_seqs=1, model_overrides=opts), [p])
        alone.append((outs[0].outputs[0].token_ids, torch.stack([r for _, r in got])))
    assert alone[0][0] == g["greedy_ids"].tolist()

    # 4 sequences of up to 36 tokens in 4-token blocks need ~30 blocks; 14 forces preemption
    llm = _llm(model_dirs[GOLDEN_OF[kind]], max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
               num_kv_blocks=14, model_overrides=opts)
    outs, got = run(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    per_seq: dict[int, list[torch.Tensor]] = {}
    for sid, row in got:
        per_seq.setdefault(sid, []).append(row)
    assert len(per_seq) == len(prompts)
    worst = 0.0
    # seq ids grow in request order; a preempted sequence samples again only once its tokens are recomputed
    for (ids, ref), out, sid in zip(alone, outs, sorted(per_seq)):
        assert out.outputs[0].token_ids == ids
        worst = max(worst, maxdiff(torch.stack(per_seq[sid]), ref))
    print(f"LLM {kind}: batched + chunked + {llm.engine.scheduler.num_preemptions} preemptions vs alone "
          f"max |dlogit| = {worst:.2e}")
    assert worst < TOL


# -- text in and out through a real server: the vendor's tokenizer, <eod>, the yuan2 chat format -----------

def _talking_checkpoint(golden_dir: str, dst, vocab: int, chain: dict[int, int]) -> None:
    """The golden tiny model widened to `vocab` tokens, with its attention and MLP outputs zeroed (the last
    hidden state is then the current token's embedding, normalised) and an untied lm_head whose row
    `chain[c]` is c's embedding: greedy decoding walks the chain c -> chain[c], through the whole engine."""
    import json

    g = torch.Generator().manual_seed(0)
    tensors = load_file(os.path.join(golden_dir, "model.safetensors"))
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) * 0.01
    for cur, nxt in chain.items():
        head[nxt] = embed[cur]
    tensors.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": torch.ones(hidden)})
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"))
    with open(os.path.join(golden_dir, "config.json")) as f:
        cfg = json.load(f)
    for k in ("eos_token_id", "eod_token_id", "bos_token_id", "pad_token_id", "sep_token_id", "mask_token_id"):
        cfg.pop(k)  # nothing names <eod> but the tokenizer: generation must still end there
    cfg.update(vocab_size=vocab, tie_word_embeddings=False)
    (dst / "config.json").write_text(json.dumps(cfg))


YUAN_CHAT_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                   {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Write about spring"}]
YUAN_CHAT_TEXT = "Be brief.\nHi\nthere<n>Hello!<n>Write about spring<sep>"  # FastChat's yuan2 conversation


@pytest.mark.parametrize("kind,tokenizer", [("dense", "vendor"), ("m32", "vendor"), ("dense", "yuan-like")])
def test_served_text_in_and_out(kind, tokenizer, request, tmp_path):
    """Prompt ids as the vendor makes them, generation ending at <eod> with finish reason `stop` and no <eod>
    in the text, and a two-turn chat in the vendor's format, through `ferry serve` and the openai client."""
    import httpx
    import sentencepiece as spm

    openai = pytest.importorskip("openai")
    from helpers import vendor_encode

    from ferrylm.tokenizer import Tokenizer

    tok_dir = request.getfixturevalue("yuan_vendor_tokenizer_dir" if tokenizer == "vendor" else "yuan_like_tokenizer_dir")
    for f in os.listdir(tok_dir):
        if f != "golden_encodings.json":
            os.symlink(os.path.join(tok_dir, f), tmp_path / f)
    (tmp_path / "config.json").write_text('{"architectures": ["YuanForCausalLM"]}')
    tok = Tokenizer.load(str(tmp_path))  # only to pick the chain's tokens and the expected ids
    eod, sep = tok.token_to_id("<eod>"), tok.token_to_id("<sep>")
    words = [i for i in dict.fromkeys(tok.encode("spring is warm and the world is new")) if i not in (eod, sep)][:4]
    chain = dict(zip([sep] + words, words + [eod]))
    _talking_checkpoint(os.path.join(DATA, GOLDEN_OF[kind]), tmp_path, tok.vocab_size, chain)
    answer = tok.decode(words)
    assert answer and answer == answer.lstrip()

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    specials = {s: tok.token_to_id(s) for s in ("<eod>", "<sep>", "<pad>", "<mask>")}
    prompt = "Write a short story about spring.<sep>"
    from serving import Server

    server = Server(["--model", str(tmp_path), "--served-model-name", "yuan", "--dtype", "float32",
                     "--max-model-len", "128", "--max-num-seqs", "4", "--disable-access-log"])
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            chat_ids = http.post("/tokenize", json={"messages": YUAN_CHAT_TURNS}).json()["tokens"]
        assert ids == vendor_encode(sp, specials, prompt)
        if tokenizer == "vendor":
            assert ids == [14350, 263, 3273, 5828, 1048, 6709, 29889, 77187]  # golden_encodings.json, case 0
        assert chat_ids == vendor_encode(sp, specials, YUAN_CHAT_TEXT)

        out = client.completions.create(model="yuan", prompt=prompt, max_tokens=20, temperature=0)
        c = out.choices[0]
        print(f"{kind}/{tokenizer}: completion {c.text!r} ({c.finish_reason}), usage {out.usage}")
        assert c.finish_reason == "stop" and c.text == answer and "<eod>" not in c.text
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(words) + 1  # + <eod>

        chat = client.chat.completions.create(model="yuan", messages=YUAN_CHAT_TURNS, max_tokens=20, temperature=0)
        assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == answer
        assert chat.usage.prompt_tokens == len(chat_ids)
        stream = client.chat.completions.create(model="yuan", messages=YUAN_CHAT_TURNS, max_tokens=20,
                                                temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    finally:
        rc = server.stop()
        log = server.log_text()
        os.unlink(server.log.name)
    assert rc == 0 and "Traceback" not in log, log
