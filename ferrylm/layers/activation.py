"""Activation functions by their HF `hidden_act` names."""

import torch.nn.functional as F

from ferrylm.errors import ConfigError

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ConfigError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTS)}") from None
