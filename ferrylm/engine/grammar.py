"""Structured outputs: a `StructuredOutput` compiled by llguidance into per-sequence matchers and token masks.

Owns: turning a JSON schema / regex / choice list / Lark or GBNF grammar into an llguidance grammar (with a
400-style `InvalidRequestError` naming what is wrong), one `LLMatcher` per constrained sequence, filling the
batch's allowed-token bitmask in one parallel call, and feeding each sampled token back to its matcher.
Does not know sampling (the sampler applies the bitmask it is handed), HTTP, or the OpenAI field names.

llguidance needs the tokenizer as HF `tokenizer.json` text; building its token trie takes about a second,
so it is built once, on first use, and shared (matchers are cheap). Masks are computed on the CPU into
one [B, ceil(V/32)] int32 bitmask per step for all constrained rows at once; the sampler moves it to the
logits' device in one copy.
"""

from __future__ import annotations

import json
import threading

import torch

from ferrylm.errors import InvalidRequestError
from ferrylm.sampling_params import StructuredOutput

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written as `json.dumps` writes it: with free whitespace a small model can pad with newlines until
max_tokens runs out, and the output no longer parses."""


def grammar_source(so: StructuredOutput) -> str:
    """The llguidance grammar for `so`; InvalidRequestError when the spec has the wrong shape."""
    from llguidance import grammar_from

    try:
        if so.kind in ("json", "json_object"):
            from llguidance import LLMatcher

            schema = {"type": "object"} if so.kind == "json_object" else so.spec
            if not isinstance(schema, (dict, str)):
                raise InvalidRequestError("a JSON schema must be an object", param=_param(so))
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if so.kind == "regex":
            if not isinstance(so.spec, str):
                raise InvalidRequestError("guided_regex must be a string", param="guided_regex")
            return grammar_from("regex", so.spec)
        if so.kind == "choice":
            if not isinstance(so.spec, list) or not so.spec or not all(isinstance(c, str) and c for c in so.spec):
                raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings",
                                          param="guided_choice")
            return grammar_from("choice", json.dumps(so.spec))
        if so.kind == "grammar":
            if not isinstance(so.spec, str):
                raise InvalidRequestError("guided_grammar must be a string", param="guided_grammar")
            return grammar_from("grammar", so.spec)
    except ValueError as e:
        raise InvalidRequestError(f"invalid {so.kind} constraint: {e}", param=_param(so)) from None
    raise InvalidRequestError(f"unknown structured output kind {so.kind!r} (one of {', '.join(KINDS)})",
                              param="response_format")


def _param(so: StructuredOutput) -> str:
    return {"json": "response_format", "json_object": "response_format"}.get(so.kind, f"guided_{so.kind}")


class GrammarEngine:
    """The tokenizer-bound part: validation and matchers. Thread-safe (the server validates on its workers)."""

    def __init__(self, backend, vocab_size: int, eos_token_ids: list[int]):
        """`backend`: the `tokenizers.Tokenizer` (serialised to JSON for llguidance on first use)."""
        self._backend, self.vocab_size, self._eos = backend, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._tok = None
        self._executor = None

    @property
    def lltokenizer(self):
        with self._lock:
            if self._tok is None:
                from llguidance import LLExecutor, LLTokenizer

                self._tok = LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)
                self._executor = LLExecutor()
            return self._tok

    def compile(self, so: StructuredOutput) -> str:
        """The grammar, checked against the tokenizer; InvalidRequestError naming the problem otherwise."""
        from llguidance import LLMatcher

        grammar = grammar_source(so)
        err = LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if err:
            raise InvalidRequestError(f"invalid {so.kind} constraint: {err}", param=_param(so))
        return grammar

    def matcher(self, so: StructuredOutput):
        from llguidance import LLMatcher

        m = LLMatcher(self.lltokenizer, self.compile(so), log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {so.kind} constraint: {m.get_error()}", param=_param(so))
        return m

    def fill_bitmask(self, matchers: list) -> torch.Tensor:
        """Allowed tokens of each matcher: [M, ceil(V/32)] int32 (bit t%32 of word t//32), in one parallel call."""
        from llguidance.torch import fill_next_token_bitmask_par

        _ = self.lltokenizer
        mask = torch.empty(len(matchers), (self.vocab_size + 31) // 32, dtype=torch.int32)  # [M, W]
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask
