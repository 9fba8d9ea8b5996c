"""A random-weight GGUF in llama.cpp's own layout, for the llama.cpp side of issue 10's hybrid comparison
(benchmarks/device_llamacpp.sh): the Mixtral-8x7B shape (llama.cpp's `llama` arch with 8 experts) or the
Qwen3-30B-A3B shape (`qwen3moe`), `--layers` of them, as bf16 or as llama.cpp's Q4_K_M mixture.

Quantized tensors are written block by block as random bytes with their scales set to small fixed values, so the
weights are finite, bounded and zero-mean and the activations stay finite (the routers, f32, are random normal:
each token picks its own experts). No quantizer runs, so a 17 GB file takes the time of writing it. Every layer shares one
random buffer per tensor shape and type (llama.cpp's speed does not depend on the values; the routers differ).
The Q4_K_M mixture follows llama.cpp's `llama_tensor_get_type_impl`: experts' gate and up Q4_K, their down Q6_K
on the "more bits" layers, attention v Q6_K there, k and v Q8_0 for 8-expert models, output Q6_K. Standalone: it
imports only numpy and gguf (llama.cpp's gguf-py).

    python benchmarks/llamacpp_gguf.py --shape qwen3-30b --quant q4_k_m --out /tmp/qwen3.gguf
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

SHAPES = {  # the fields of benchmarks/bench_offload.py's MIXTRAL and QWEN3_30B that llama.cpp needs
    "mixtral": dict(arch="llama", vocab=32000, hidden=4096, ff=14336, expert_ff=14336, heads=32, kv_heads=8,
                    head_dim=128, experts=8, used=2, layers=32, eps=1e-5, rope=1e6, qk_norm=False),
    "qwen3-30b": dict(arch="qwen3moe", vocab=151936, hidden=2048, ff=6144, expert_ff=768, heads=32, kv_heads=4,
                      head_dim=128, experts=128, used=8, layers=48, eps=1e-6, rope=1e6, qk_norm=True),
    "tiny-qwen3": dict(arch="qwen3moe", vocab=512, hidden=256, ff=512, expert_ff=256, heads=4, kv_heads=2,
                       head_dim=64, experts=8, used=2, layers=4, eps=1e-6, rope=1e6, qk_norm=True),
    "tiny-mixtral": dict(arch="llama", vocab=512, hidden=256, ff=512, expert_ff=512, heads=4, kv_heads=2,
                         head_dim=64, experts=4, used=2, layers=4, eps=1e-5, rope=1e6, qk_norm=False),
}
Q = gguf.GGMLQuantizationType
# Each block's fp16 scale fields: (byte offset, value) (ggml-common.h's block_q4_K, block_q5_K, block_q6_K,
# block_q8_0). The K-quants with a min (w = d * sc * q - dmin * m, sc and m 6-bit) get dmin = E[q] * d, so random
# bytes give zero-mean weights: with dmin = d every weight leaned positive, the residual stream turned nearly
# constant after a few Q4_K layers, and the routers sent every token to the same experts (a review's simulation of
# the Qwen3 shape: 17 distinct experts a layer at 16 tokens, where bf16 gives ~80).
HALF_FIELDS = {Q.Q4_K: ((0, 1e-4), (2, 7.5 * 1e-4)), Q.Q5_K: ((0, 1e-4), (2, 15.5 * 1e-4)),
               Q.Q6_K: ((208, 1e-5),), Q.Q8_0: ((0, 1e-4),)}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers Q4_K_M gives Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Buffers:
    """One random buffer per (shape, type), shared by every tensor of that shape and type."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.cache: dict = {}

    def get(self, shape: tuple, qtype) -> np.ndarray:
        key = (shape, qtype)
        if key not in self.cache:
            self.cache[key] = self._make(shape, qtype)
        return self.cache[key]

    def _make(self, shape: tuple, qtype) -> np.ndarray:
        if qtype == Q.F32:
            return np.ones(shape, np.float32)
        if qtype == Q.BF16:
            x = self.rng.standard_normal(shape, np.float32)
            return ((x * 0.02).view(np.uint32) >> 16).astype(np.uint16)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        assert cols % block == 0, f"{shape} does not split into {qtype.name} blocks of {block}"
        b = self.rng.integers(0, 256, (rows * (cols // block), size), np.uint8)
        for off, value in HALF_FIELDS[qtype]:
            b[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
        return b.reshape(*shape[:-1], cols // block * size)


def router(rng: np.random.Generator, experts: int, hidden: int) -> np.ndarray:
    return rng.standard_normal((experts, hidden), np.float32) * 0.02


def write(shape: str, quant: str, out: str, layers: int | None = None) -> None:
    s = dict(SHAPES[shape])
    n = layers or s["layers"]
    arch, h, hd, e = s["arch"], s["hidden"], s["head_dim"], s["experts"]
    q4 = quant == "q4_k_m"
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"random {shape} {n}L {quant}")
    w.add_file_type(15 if q4 else 32)  # LLAMA_FTYPE_MOSTLY_Q4_K_M, LLAMA_FTYPE_MOSTLY_BF16
    w.add_block_count(n)
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(s["rope"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_expert_count(e)
    w.add_expert_used_count(s["used"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(s["expert_ff"])
    # An SPM vocab llama.cpp loads: <unk>, <s>, </s>, the 256 byte tokens, then plain pieces.
    v = s["vocab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(v - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * v)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    bufs, rng = Buffers(), np.random.default_rng(1)
    big = (lambda t: t) if q4 else (lambda t: Q.BF16)

    def add(name: str, shape_: tuple, qtype) -> None:
        w.add_tensor(name, bufs.get(shape_, qtype), raw_dtype=qtype)

    add("token_embd.weight", (v, h), big(Q.Q4_K))
    add("output_norm.weight", (h,), Q.F32)
    add("output.weight", (v, h), big(Q.Q6_K))
    eight = e == 8
    for i in range(n):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (h,), Q.F32)
        add(p + "ffn_norm.weight", (h,), Q.F32)
        add(p + "attn_q.weight", (s["heads"] * hd, h), big(Q.Q4_K))
        add(p + "attn_k.weight", (s["kv_heads"] * hd, h), big(Q.Q8_0 if eight else Q.Q4_K))
        add(p + "attn_v.weight", (s["kv_heads"] * hd, h),
            big(Q.Q8_0 if eight else Q.Q6_K if more_bits(i, n) else Q.Q4_K))
        add(p + "attn_output.weight", (h, s["heads"] * hd), big(Q.Q5_K if eight else Q.Q4_K))
        if s["qk_norm"]:
            add(p + "attn_q_norm.weight", (hd,), Q.F32)
            add(p + "attn_k_norm.weight", (hd,), Q.F32)
        w.add_tensor(p + "ffn_gate_inp.weight", router(rng, e, h))
        add(p + "ffn_gate_exps.weight", (e, s["expert_ff"], h), big(Q.Q4_K))
        add(p + "ffn_up_exps.weight", (e, s["expert_ff"], h), big(Q.Q4_K))
        add(p + "ffn_down_exps.weight", (e, h, s["expert_ff"]), big(Q.Q6_K if more_bits(i, n) else Q.Q4_K))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--quant", choices=("q4_k_m", "bf16"), required=True)
    ap.add_argument("--layers", type=int, help="default: the shape's own")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    write(a.shape, a.quant, a.out, a.layers)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
