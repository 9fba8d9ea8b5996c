"""RandomSource: seeded random weights for a config, under the model's own parameter names, so a model
of any real shape loads in seconds with no checkpoint on disk (benchmarks, tests of large shapes).

Values are N(0, std) drawn once into a pool and tiled (fast enough for tens of GB; not zeros, which
would hide bugs and time differently); norms are 1. The names are ferrylm's fused parameter names
(`qkv_proj`, stacked expert banks), which the loader fills directly.
"""

from __future__ import annotations

import torch

from ferrylm.config import ModelConfig
from ferrylm.weights.source import WeightSource


class RandomSource(WeightSource):
    def __init__(self, config: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02,
                 pool_elements: int = 1 << 24):
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
        self.offset = 0

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.rpartition(".")[0] in self.norms:
            return torch.ones(shape, dtype=self.dtype)
        t = torch.empty(shape, dtype=self.dtype)
        flat, n, done = t.view(-1), t.numel(), 0
        while done < n:  # tile the pool from a moving offset, so tensors differ from one another
            a = self.offset % self.pool.numel()
            k = min(n - done, self.pool.numel() - a)
            flat[done:done + k].copy_(self.pool[a:a + k])
            done += k
            self.offset += k + 7919
        return t
