"""LLM: the offline API. `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages)`.

A thin loop over `LLMEngine.step()`; it adds no behaviour of its own beyond ordering outputs as the
prompts were given and an optional progress bar.
"""

from __future__ import annotations

from typing import Sequence as Seq

from ferrylm.config import engine_config
from ferrylm.engine.llm_engine import LLMEngine, RequestOutput
from ferrylm.errors import InvalidRequestError
from ferrylm.sampling_params import SamplingParams

Prompt = str | list[int] | dict
"""Text, token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": [...]}`."""


def _plain_prompt(p: Prompt) -> str | list[int]:
    if not isinstance(p, dict):
        return p
    if "prompt_token_ids" in p:
        return list(p["prompt_token_ids"])
    if "prompt" in p:
        return p["prompt"]
    raise InvalidRequestError(f"a dict prompt needs `prompt` or `prompt_token_ids`, got keys {sorted(p)}",
                              param="prompt")


class LLM:
    def __init__(self, model: str | None = None, *, progress=None, **options):
        """`options`: any engine knob by its config field name (`ferrylm/config.py`: device, dtype, seed,
        max_num_seqs, num_kv_blocks, gpu_memory_budget, place, ...)."""
        options["model_overrides"] = options.get("model_overrides") or {}
        config = engine_config(model=model, **options)
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        if config.offload.profile_experts:  # a warm-up that records routing for the next start's placement
            from ferrylm.offload import expert_profile

            expert_profile.warm_up(self, config.offload.profile_experts, config.model, config.seed)

    def close(self) -> None:
        """Give back the engine's device memory, host registrations and threads now (`LLMEngine.close`), not
        when the collector gets to it: call it (or use `with LLM(...) as llm:`) before building another engine
        in the same process. Dropping the last reference to the engine frees the same memory by reference counting
        (no cycle holds it) but leaves the threads to end on their own; no finalizer closes it, since
        `LLM(...).engine` outlives its LLM (the server). Idempotent; the LLM is unusable after."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_plain_prompt(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:  # nothing half-submitted stays in the engine
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer_required().encode(
            self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
            add_special_tokens=False) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from rich.progress import Progress

            bar = Progress(transient=True)
            task = bar.add_task("generating", total=len(ids))
            bar.start()
        mine = set(ids)
        try:
            while len(final) < len(ids):
                for o in self.engine.step(final_only=True):  # only finished outputs are kept
                    if o.finished and o.request_id in mine:
                        final[o.request_id] = o
                        if bar:
                            bar.advance(task)
        except BaseException:  # a failed step or Ctrl-C: nothing of this call stays in the engine
            for rid in mine.difference(final):
                self.engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.stop()
        return [final[i] for i in ids]
