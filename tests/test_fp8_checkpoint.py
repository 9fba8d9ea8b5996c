"""Block-wise FP8 checkpoints, the format of DeepSeek-V3's and the Qwen3 FP8 releases (`quantization_config`
{"quant_method": "fp8", "weight_block_size": [bn, bk]}: e4m3 `weight` [N, K] and an fp32 `weight_scale_inv`
[ceil(N/bn), ceil(K/bk)] per Linear of the decoder layers). Built here from transformers models: every decoder
Linear but the router block-quantized as those releases are, beside the same weights dequantized in fp32 (the
reference). ferrylm on the FP8 directory gives exactly the logits it gives on the dequantized one, and matches
transformers on those weights; the FP8 weights whose rows are a multiple of bk stay packed."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.errors import ModelLoadError  # noqa: E402
from ferrylm.weights import quant  # noqa: E402
from ferrylm.weights.source import SafetensorsSource, open_source  # noqa: E402

from helpers import capture_logits  # noqa: E402
from test_models import DEEPSEEK, build, compare, prompts_of  # noqa: E402

BLOCK = (16, 16)
"""The releases use 128 x 128; these models are 24-112 wide, so 16 x 16 gives full blocks, part blocks along N (40
rows) and a K that is no multiple of the block (q_b_proj's 24: dequantized at load)."""


def fp8_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block's absmax to 448."""
    n, k = w.shape
    bn, bk = block
    pad = torch.nn.functional.pad(w.float(), (0, (-k) % bk, 0, (-n) % bn))
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / quant.FP8_MAX, torch.ones_like(amax))
    codes = (w.float() / s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]).to(torch.float8_e4m3fn)
    return codes, s


def quantized(name: str, t: torch.Tensor) -> bool:
    """What the releases block-quantize: the decoder layers' 2-D Linear weights, not norms or routers."""
    return (".layers." in name and name.endswith(".weight") and t.dim() == 2 and not name.endswith("mlp.gate.weight"))


def fp8_pair(tmp_path_factory, family: str, block=BLOCK) -> tuple[str, str, object]:
    """(FP8 checkpoint dir, dequantized fp32 dir, transformers model on the dequantized weights)."""
    from safetensors.torch import load_file, save_file

    path, _ = build(tmp_path_factory, f"{family}-fp8-src", *DEEPSEEK[family])
    tensors = load_file(str(Path(path) / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if quantized(name, t):
            codes, s = fp8_blocks(t, block)
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = codes, s
            deq[name] = quant.fp8_block_dequantize(codes, s, block, torch.float32)
        else:
            fp8[name] = deq[name] = t
    dirs = []
    for kind, tens in (("fp8", fp8), ("deq", deq)):
        d = tmp_path_factory.mktemp(f"{family}-{kind}")
        for f in Path(path).iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
        save_file(tens, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    cfg = json.loads((dirs[0] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic",
                                  "fmt": "e4m3"}
    (dirs[0] / "config.json").write_text(json.dumps(cfg))
    ref = getattr(transformers, DEEPSEEK[family][1]).from_pretrained(str(dirs[1]), dtype=torch.float32).eval()
    return str(dirs[0]), str(dirs[1]), ref


def logits(llm, prompts) -> list[torch.Tensor]:
    with capture_logits(llm.engine) as got:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    rows: dict[int, list] = {}
    for sid, row in got:
        rows.setdefault(sid, []).append(row.float())
    return [torch.stack(v) for _, v in sorted(rows.items())]


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_fp8_checkpoint_equals_its_dequantized_weights(family, tmp_path_factory):
    fp8, deq, ref = fp8_pair(tmp_path_factory, family)
    src = open_source(fp8)
    assert isinstance(src, SafetensorsSource) and src.fp8_block == BLOCK
    assert not any(k.endswith("weight_scale_inv") for k in src.keys())
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [64, 32]: packed, exactly the dequantized values
    qt = src.get_quantized(name)
    assert qt.scheme == "fp8" and qt.params == {"group_size": BLOCK[1]} and qt.parts["q"].dtype == torch.uint8
    assert torch.equal(qt.dequantize(torch.float32), src.get(name))
    assert src.get_quantized("model.layers.0.self_attn.q_b_proj.weight") is None  # K = 24: dense through get
    assert src.get_quantized("model.embed_tokens.weight") is None
    prompts = prompts_of(11, 19)
    got = LLM(fp8, dtype="float32", max_num_seqs=4)
    packed = [n for n, m in got.engine.runner.model.named_modules() if getattr(m, "packed_shards", None)]
    assert "model.layers.0.self_attn.o_proj" in packed and "model.layers.0.self_attn.q_b_proj" not in packed
    assert "model.layers.0.self_attn.kv_b_proj" not in packed  # absorbed MLA reads it dense every step
    for n in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_b_proj.weight"):
        info, qt = src.quantized_info(n), src.get_quantized(n)  # headers alone: what the read would give
        assert (info is None) == (qt is None) and (qt is None or (info.shape, info.nbytes) == (qt.shape, qt.nbytes))
    a, b = logits(got, prompts), logits(LLM(deq, dtype="float32", max_num_seqs=4), prompts)
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"{family} FP8 blocks {BLOCK} vs the same weights dequantized: max |logit diff| {worst:.3e}; "
          f"{len(packed)} Linears kept packed")
    assert worst == 0.0
    compare(f"{family}-fp8", fp8, ref, prompts)  # and transformers on the dequantized weights


def test_fp8_linears_on_the_native_kernel_match_the_plain_path(tmp_path_factory):
    """Blocks of 32: the CPU engine's FP8 Linears whose rows are a multiple of 32 run `host_native.gemv_fp8`
    (`qmatmul.Fp8NativeCPU`: bf16 activations, like the CPU's int4 / int8 kernels) where it builds, within bf16's
    rounding of the dequantized checkpoint's logits; `dequantize=True` (the plain path) equals them exactly."""
    from ferrylm.layers.qmatmul import Fp8NativeCPU

    fp8, deq, _ = fp8_pair(tmp_path_factory, "deepseek_v3", block=(32, 32))
    prompts = prompts_of(11, 19)
    got = LLM(fp8, dtype="float32", max_num_seqs=4)
    kernels = {type(k).__name__ for m in got.engine.runner.model.modules() for k in getattr(m, "kernels", [])}
    native = Fp8NativeCPU.usable(quant.quantize_fp8(torch.ones(32, 64), 32))
    assert ("Fp8NativeCPU" in kernels) == native, kernels
    ref = logits(LLM(deq, dtype="float32", max_num_seqs=4), prompts)
    plain = logits(LLM(fp8, dtype="float32", max_num_seqs=4, dequantize=True), prompts)
    assert all(torch.equal(a, b) for a, b in zip(plain, ref))
    worst = 0.0
    for x, y in zip(logits(got, prompts), ref):  # rows up to the first greedy token that differs (same contexts)
        same = (x.argmax(-1) == y.argmax(-1)).long().cumprod(0)
        n = int(same.sum()) + (1 if same.sum() < len(same) else 0)
        worst = max(worst, ((x[:n] - y[:n]).abs().max() / y[:n].abs().max()).item())
    print(f"FP8 Linears on {sorted(kernels)} vs the dequantized checkpoint: max |logit diff| {worst:.2e} of the scale "
          "over the same contexts")
    assert worst < 2 ** -5


def test_fp8_checkpoint_converts_to_a_store_that_keeps_it_packed(tmp_path_factory):
    from ferrylm.weights.convert import ConvertOptions, convert

    fp8, deq, _ = fp8_pair(tmp_path_factory, "deepseek_v3")
    store = str(tmp_path_factory.mktemp("fp8-store") / "s")
    report = convert(fp8, store, ConvertOptions())
    assert report.packed > 0
    src = open_source(store)
    assert "quantization_config" not in src.config
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert torch.equal(src.get_quantized(name).dequantize(torch.float32), open_source(fp8).get(name))
    prompts = prompts_of(9)
    a = logits(LLM(store, dtype="float32"), prompts)
    b = logits(LLM(deq, dtype="float32"), prompts)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("qc,match", [({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
                                      ({"quant_method": "fp8"}, "weight_block_size"),
                                      ({"quant_method": "fp8", "weight_block_size": [16, 16],
                                        "activation_scheme": "static"}, "activation_scheme 'static'")])
def test_unsupported_quantization_configs_are_named(qc, match, tmp_path_factory):
    path, _ = build(tmp_path_factory, "llama-qc", "LlamaConfig", "LlamaForCausalLM", {})
    cfg = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ModelLoadError, match=match):
        LLM(path)


def test_fp8_weight_with_wrong_scales_is_named(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    fp8, _, _ = fp8_pair(tmp_path_factory, "deepseek_v3")
    f = Path(fp8) / "model.safetensors"
    t = load_file(str(f))
    bad = "model.layers.0.mlp.up_proj.weight_scale_inv"
    t[bad] = t[bad][:1]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight.*not block-wise FP8.*\(scales \(6, 4\) expected\)"):
        LLM(fp8, dtype="float32")
    del t[bad]  # an FP8 weight without its scales: named, never loaded as raw e4m3 values
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj.weight' is torch.float8_e4m3fn but the checkpoint has no "
                                             "model.layers.0.mlp.up_proj.weight_scale_inv"):
        LLM(fp8, dtype="float32")


def test_bf16_scales_load_as_their_values(tmp_path_factory):
    """Qwen3's FP8 releases store `weight_scale_inv` in bf16 (DeepSeek's in fp32): the same values either way."""
    from safetensors.torch import load_file, save_file

    fp8, _, _ = fp8_pair(tmp_path_factory, "deepseek_v3")
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    before = open_source(fp8).get(name)
    f = Path(fp8) / "model.safetensors"
    t = load_file(str(f))
    for k in [k for k in t if k.endswith("weight_scale_inv")]:
        t[k] = t[k].to(torch.bfloat16)
    save_file(t, str(f), metadata={"format": "pt"})
    src = open_source(fp8)
    scale = t[name.removesuffix(".weight") + ".weight_scale_inv"].float()
    assert torch.equal(src.get(name), quant.fp8_block_dequantize(t[name], scale, BLOCK, torch.float32))
    assert torch.equal(src.get_quantized(name).dequantize(torch.float32), src.get(name))
    assert (src.get(name) - before).abs().max() <= before.abs().max() * 2 ** -8  # bf16-rounded scales


def test_plan_counts_an_fp8_checkpoint_as_the_engine_loads_it(tmp_path_factory):
    """`ferry plan` on a block-wise FP8 directory: every tensor group's bytes (codes plus fp32 row-group scales;
    K = 24 rows dequantized) equal what the engine sizes for placement after noting packed Linears and packing
    experts (bf16 activations: the engine packs experts for a half dtype only), well under the bf16 model's; and
    the plan says so."""
    from ferrylm.config import ModelConfig
    from ferrylm.offload.placement import group_tensors
    from ferrylm.plan.memory import WeightFormat, meta_model, weight_groups
    from ferrylm.plan.planner import PlanOptions, make_plan

    fp8, deq, _ = fp8_pair(tmp_path_factory, "deepseek_v3")
    src = open_source(fp8)
    cfg = ModelConfig.from_hf(src.config)
    engine = meta_model(cfg, "bfloat16")  # the model runner's build on meta
    assert engine.pack_experts(src) and engine.note_packed_linears(src) > 0
    want = {g.name: g.nbytes for g in group_tensors(engine)}
    fmt = WeightFormat("bfloat16", "fp8", fp8_block=BLOCK[1])
    got = {g.name: g.nbytes for g in weight_groups(meta_model(cfg, "bfloat16"), fmt)}
    assert got == want
    opts = dict(gpu="1xH200", host="2xXeon-8480C,1TB", dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    plan, dense = make_plan(PlanOptions(fp8, **opts)), make_plan(PlanOptions(deq, **opts))
    total, dense_total = sum(plan.weights_bytes.values()), sum(dense.weights_bytes.values())
    print(f"plan: FP8 checkpoint {total} B, dequantized {dense_total} B")
    assert total == sum(want.values()) and total < 0.8 * dense_total  # 0.72 at these shapes: embeddings stay bf16
    assert any("block-wise FP8 checkpoint" in n for n in plan.notes)


def test_catalog_fp8_releases_plan_at_about_half_the_bytes():
    """`ferry plan DeepSeek-V3-FP8` (the release as downloaded) counts its decoder Linears and experts as FP8 blocks:
    about half the bf16 model's bytes (embeddings, LM head, norms and routers stay bf16), and says so."""
    from ferrylm.plan.planner import PlanOptions, make_plan

    opts = dict(gpu="4xA800-80G-PCIe", host="2xXeon-8480C,1TB", max_model_len=4096, max_num_seqs=4)
    fp8, bf16 = make_plan(PlanOptions("DeepSeek-V3-FP8", **opts)), make_plan(PlanOptions("DeepSeek-V3", **opts))
    ratio = sum(fp8.weights_bytes.values()) / sum(bf16.weights_bytes.values())
    print(f"DeepSeek-V3 FP8 release / bf16: {ratio:.3f} of the bytes")
    assert 0.5 < ratio < 0.53 and any("block-wise FP8 checkpoint" in n for n in fp8.notes)
