"""ferrylm: an inference engine and OpenAI-compatible server for dense and MoE LLMs."""

from ferrylm.engine.llm import LLM
from ferrylm.engine.llm_engine import CompletionOutput, RequestOutput
from ferrylm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
