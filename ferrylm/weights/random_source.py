"""RandomSource: seeded random weights for a config, under the model's own parameter names, so a model
of any real shape loads in seconds with no checkpoint on disk (benchmarks, tests of large shapes).

Values are N(0, std) drawn once into a pool and tiled (fast enough for tens of GB; not zeros, which
would hide bugs and time differently); norms are 1. The names are ferrylm's fused parameter names
(`qkv_proj`, stacked expert banks), which the loader fills directly.

With `expert_quant` (`PACKED_SCHEMES`) the experts come as a quantized store would hand them out: one
name per expert and projection (`...experts.<e>.w1|w3|w2.weight`) and `get_quantized` returning random
packed codes with scales of the same spread, so packed-expert paths (kept packed on CUDA, read in place
over PCIe) are benchmarked at real shapes without quantizing tens of GB first. `linear_quant` does the same
for the decoder layers' Linear weights (attention and dense MLP; embeddings, norms, routers and the LM head stay
dense, as `ferry convert` leaves them): a dense model of real shape quantized, e.g. Qwen2-72B NF4 streamed.
"""

from __future__ import annotations

import torch

from ferrylm.config import ModelConfig
from ferrylm.weights.source import WeightSource


PACKED_SCHEMES = ("int8", "int4", "nf4", "fp8", "fp8-g128")
"""fp8: per channel (`ferry convert --quant fp8`); fp8-g128: a block-wise FP8 checkpoint as it loads (DeepSeek-V3,
Qwen3 FP8: groups of 128 along each row, `weights/quant.from_fp8_blocks`)."""
FP8_SPREAD = 64.0
"""fp8 random codes are e4m3 values of N(0, FP8_SPREAD): 7 standard deviations below e4m3's largest finite 448."""


class RandomSource(WeightSource):
    def __init__(self, config: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02,
                 pool_elements: int = 1 << 24, expert_quant: str | None = None, linear_quant: str | None = None):
        from ferrylm.models.registry import model_class

        self.config, self.path, self.dtype = config, f"random:{config.get('architectures', ['?'])[0]}", dtype
        cfg = ModelConfig.from_hf(config)
        cls = model_class(cfg)
        with torch.device("meta"):
            model = cls(cfg)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.norms = {n for n, m in model.named_modules() if type(m).__name__ == "RMSNorm"}
        g = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(pool_elements, generator=g) * std).to(dtype)
        self.codes = torch.randint(0, 256, (pool_elements,), generator=g, dtype=torch.uint8)
        self.offset = 0
        self.std, self.expert_quant, self.linear_quant = std, expert_quant, linear_quant
        self.experts: dict[str, tuple[int, int]] = {}  # per-expert name -> its [N, K]
        self.linears: dict[str, tuple[int, int]] = {}  # packed Linear weight name -> its [N, K]
        for knob, value in (("expert_quant", expert_quant), ("linear_quant", linear_quant)):
            if value not in (None, *PACKED_SCHEMES):
                raise ValueError(f"{knob} {value!r}: choose one of {', '.join(PACKED_SCHEMES)}")
        if {expert_quant, linear_quant} & {"fp8", "fp8-g128"}:  # e4m3 codes of N(0, 1) * FP8_SPREAD: N(0, std) at scale std / it
            self.fp8_codes = (torch.randn(pool_elements, generator=g) * FP8_SPREAD).clamp(-448, 448).to(
                torch.float8_e4m3fn).view(torch.uint8)
        if linear_quant is not None:
            from ferrylm.layers.linear import Linear

            for n, m in model.named_modules():
                w = f"{n}.weight"
                if (isinstance(m, Linear) and ".layers." in f".{n}" and w in self.shapes
                        and not n.endswith(("router", "gate")) and self.shapes[w][1] % 64 == 0):
                    self.linears[w] = self.shapes[w]
        if expert_quant is not None:
            for n, m in model.named_modules():
                if type(m).__name__ == "Experts":
                    I = m.inter
                    del self.shapes[f"{n}.w13"], self.shapes[f"{n}.w2"]
                    parts = ((("w1", (2 * I, m.hidden)),) if getattr(cls, "expert_w1_stacked", False) else
                             (("w1", (I, m.hidden)), ("w3", (I, m.hidden))))  # gate (and up), as checkpoints name them
                    for e in range(m.num_experts):
                        for part, shape in (*parts, ("w2", (m.hidden, I))):
                            self.experts[f"{n}.{e}.{part}.weight"] = shape

    def keys(self) -> list[str]:
        return list(self.shapes) + list(self.experts)

    def _tile(self, pool: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        flat, n, done = t.view(-1), t.numel(), 0
        while done < n:  # tile the pool from a moving offset, so tensors differ from one another
            a = self.offset % pool.numel()
            k = min(n - done, pool.numel() - a)
            flat[done:done + k].copy_(pool[a:a + k])
            done += k
            self.offset += k + 7919
        return t

    def get_quantized(self, name: str):
        return self._packed(name)

    def _packed(self, name: str):
        from ferrylm.weights.quant import NF4_LEVELS, QuantizedTensor

        shape = self.experts.get(name) or self.linears.get(name)
        if shape is None:
            return None
        N, K = shape
        if (self.expert_quant if name in self.experts else self.linear_quant) == "int8":  # codes uniform in [-127, 127]: values of spread std
            q = self._tile(self.codes, torch.empty(N, K, dtype=torch.uint8)).view(torch.int8)
            q[q == -128] = 0
            scale = torch.full((N,), self.std * 3 ** 0.5 / 127)
            return QuantizedTensor("int8", (N, K), {"q": q, "scale": scale}, {}, self.dtype)
        if (self.expert_quant if name in self.experts else self.linear_quant) == "int4":  # symmetric, group 32
            if K % 32:
                raise ValueError(f"int4 random weights need K a multiple of 32: {name} is [{N}, {K}]")
            q = self._tile(self.codes, torch.empty(N, K // 2, dtype=torch.uint8))  # nibbles uniform in [0, 15]
            scale = torch.full((N, K // 32), self.std / 4.6, dtype=torch.float16)  # (q - 8) has rms ~4.6
            return QuantizedTensor("int4", (N, K), {"q": q, "scale": scale}, {"group_size": 32, "zero": "sym"},
                                   self.dtype)
        scheme = self.expert_quant if name in self.experts else self.linear_quant
        if scheme == "fp8":  # per channel, like int8
            q = self._tile(self.fp8_codes, torch.empty(N, K, dtype=torch.uint8))
            scale = torch.full((N,), self.std / FP8_SPREAD)
            return QuantizedTensor("fp8", (N, K), {"q": q, "scale": scale}, {}, self.dtype)
        if scheme == "fp8-g128":  # a block-wise checkpoint's layout: one fp32 scale per row and 128 columns
            if K % 128:
                raise ValueError(f"fp8-g128 random weights need K a multiple of 128: {name} is [{N}, {K}]")
            q = self._tile(self.fp8_codes, torch.empty(N, K, dtype=torch.uint8))
            scale = torch.full((N, K // 128), self.std / FP8_SPREAD)
            return QuantizedTensor("fp8", (N, K), {"q": q, "scale": scale}, {"group_size": 128}, self.dtype)
        q = self._tile(self.codes, torch.empty(N * K // 2, dtype=torch.uint8))
        absmax = torch.full((N * K // 64,), self.std / float(NF4_LEVELS.pow(2).mean().sqrt()))
        return QuantizedTensor("nf4", (N, K), {"q": q, "absmax": absmax}, {"group_size": 64, "double_quant": False},
                               self.dtype)

    def get(self, name: str) -> torch.Tensor:
        if name in self.experts or name in self.linears:
            return self._packed(name).dequantize(self.dtype)  # (the engine may switch get_quantized off)
        shape = self.shapes[name]
        if name.rpartition(".")[0] in self.norms:
            return torch.ones(shape, dtype=self.dtype)
        return self._tile(self.pool, torch.empty(shape, dtype=self.dtype))
