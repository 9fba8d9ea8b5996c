"""Text <-> token ids, chat templates and streaming detokenization.

Owns: building a `tokenizers.Tokenizer` from an HF directory (tokenizer.json, or a SentencePiece
tokenizer.model alone) or from a GGUF file's `tokenizer.ggml.*` metadata; which ids end generation;
rendering the model's Jinja chat template in a sandbox; turning a stream of ids into text deltas.
Does not know models, tensors, requests or sampling: the engine hands ids in and gets text out.

GGUF tokenizers follow llama.cpp, the format's reference implementation: byte-level BPE (`gpt2`) splits
text with the regexes llama.cpp uses for the file's `tokenizer.ggml.pre`; SentencePiece-style vocabularies
(`llama`) run BPE over merges ranked by token score, with a space prepended to each text fragment.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ferrylm.errors import InvalidRequestError, ModelLoadError

SPIECE_UNDERLINE = "\u2581"
_GIL_FREE_CHARS = 4096
"""Texts longer than this are encoded with the GIL released (encode_batch), so other threads keep running."""

# llama.cpp token types (the same numbers as SentencePiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn tokens: if one of these is a token of the vocabulary and the chat template writes it,
# generation must stop on it even when the file names a different EOS (SmolLM, Qwen, Llama 3, Gemma...).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                "<|end_of_text|>", "</s>", "<eod>")


@dataclass(frozen=True)
class FamilyText:
    """How a family's text is served when its vendor fixes it in serving code rather than in the tokenizer
    files (keyed by HF architecture). Each field overrides what the files say; None keeps the files' value."""

    special_tokens: tuple[str, ...] = ()
    """Added as special tokens: matched whole in text, skipped in decoded output."""
    eos_token: str | None = None
    """The end-of-text token (stops generation with any end ids the configs list)."""
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None
    """Used when the model directory has no chat template of its own."""


# Yuan 2.0's chat format: FastChat's `yuan2` conversation (the vendor's FastChat adapter), also what
# YuanChat sends: "[system\n]turn<n>turn<n>...turn<sep>"; the answer follows <sep> and ends at <eod>.
# Turns are joined by the literal text "<n>" as those servers write it. Newlines inside a message stay
# "\n": the vendor's data files escape a newline as "<n>" only to keep one sample per line, and its
# preprocessing (tools/preprocess_data_yuan.py) turns "<n>" back into "\n" before tokenizing, so the model
# was trained on real newlines (id 13). FastChat strips the last "<n>" with `rstrip("<n>")`, which also eats a
# last message's trailing "n", "<" or ">" characters; the join below has the intended effect without that.
YUAN2_CHAT_TEMPLATE = (
    "{% set ns = namespace(first=true) %}"
    "{% for m in messages %}"
    "{% if loop.first and m['role'] == 'system' %}"
    "{% if m['content'] %}{{ m['content'] }}{{ '\\n' }}{% endif %}"
    "{% elif m['content'] %}"
    "{% if not ns.first %}<n>{% endif %}{{ m['content'] }}{% set ns.first = false %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<sep>{% endif %}")

# Yuan 2.0's vendor servers (its vLLM fork, FastChat adapter, OpenAI API server) load the tokenizer with
# add_bos_token=False, add_eos_token=False, eos_token='<eod>', whatever tokenizer_config.json says, then
# `add_tokens(..., special_tokens=True)` the 15 tokens below; `<eod>` is special as the eos token.
_FAMILY_TEXT = {
    "YuanForCausalLM": FamilyText(
        special_tokens=("<eod>", "<sep>", "<pad>", "<mask>", "<predict>", "<FIM_SUFFIX>", "<FIM_PREFIX>",
                        "<FIM_MIDDLE>", "<commit_before>", "<commit_msg>", "<commit_after>", "<jupyter_start>",
                        "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>"),
        eos_token="<eod>", add_bos=False, add_eos=False, chat_template=YUAN2_CHAT_TEMPLATE),
}

# ----- llama.cpp pre-tokenizer regexes, by `tokenizer.ggml.pre` (llama-vocab.cpp), in HF regex syntax -----
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_SPLITS = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_DEFAULT_SPLITS = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _pre_table() -> dict[str, tuple[list[str], bool]]:
    """`tokenizer.ggml.pre` -> (regexes applied in sequence, ignore_merges)."""
    table: dict[str, tuple[list[str], bool]] = {"default": (_DEFAULT_SPLITS, False)}
    for names, splits, ignore in (
        (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
          "jina-v5-nano", "dbrx", "smaug-bpe"), [_LLAMA3_SPLIT], True),
        (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"), [_QWEN2_SPLIT], False),
        (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
         [r"\p{N}", _GPT2_SPLIT], False),
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "jina-es", "jina-de", "gigachat",
          "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "granite-docling"), [_GPT2_SPLIT], False),
        (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), [_GPT4O_SPLIT], False),
        (("tekken",), [_TEKKEN_SPLIT], True),
        (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"], False),
        (("deepseek-v3", "hunyuan-dense"), _DEEPSEEK3_SPLITS, False),
        (("deepseek-coder",), ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False),
    ):
        for n in names:
            table[n] = (splits, ignore)
    return table


_PRE_TOKENIZERS = _pre_table()


class TooManyTokensError(InvalidRequestError):
    """A text longer than the `limit` given to `Tokenizer.encode`; `count` is about how many tokens it has."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"the text has {count} tokens, more than {limit}", param="prompt")
        self.count = count


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs around it: BOS/EOS policy, chat template."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 add_bos: bool = False, add_eos: bool = False, manual_special: bool = True,
                 chat_template: str | dict[str, str] | None = None, special_tokens: dict[str, str] | None = None,
                 vocab_size: int | None = None, name: str = "", decode_by_fragment: bool = False):
        """`manual_special`: BOS/EOS are added here (GGUF, SentencePiece); False when tokenizer.json's
        post-processor adds them itself. `decode_by_fragment`: decode the runs between added tokens one by
        one, each dropping the space prefix its encoding gave it (SentencePiece directories)."""
        self._tok = tok
        self.bos_token_id = bos_token_id
        eos = [int(i) for i in eos_token_ids if i is not None]
        self.eos_token_id = eos[0] if eos else None
        """The primary EOS (the one the config names)."""
        self.add_bos, self.add_eos, self._manual_special = add_bos, add_eos, manual_special
        self.chat_templates = _template_dict(chat_template)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        """Template variables: bos_token, eos_token, unk_token, pad_token (strings)."""
        self._vocab_size = vocab_size
        self.name = name
        self._fragment_breaks = frozenset(tok.get_added_tokens_decoder()) if decode_by_fragment else frozenset()
        self.eos_token_ids: frozenset[int] = frozenset(eos) | self._end_of_turn_ids()
        """Every id that ends generation: the configured EOS plus the template's end-of-turn token."""

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_path: str) -> "Tokenizer":
        """From a .gguf file, or a directory holding tokenizer.json / tokenizer.model (or one .gguf)."""
        path = os.path.expanduser(model_path)
        if not os.path.exists(path):
            raise ModelLoadError(f"{path}: no such file or directory (looking for a tokenizer)")
        if os.path.isfile(path):
            if path.endswith(".gguf"):
                return cls.from_gguf(path)
            raise ModelLoadError(f"{path}: a tokenizer comes from a .gguf file or a model directory")
        if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
            return cls.from_dir(path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return cls.from_gguf(os.path.join(path, ggufs[0]))
        raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer.model in the model directory")

    @classmethod
    def from_dir(cls, path: str, extra_special_tokens: Iterable[str] = ()) -> "Tokenizer":
        """An HF model directory: tokenizer.json (preferred) or a SentencePiece tokenizer.model, with
        tokenizer_config.json (chat template, BOS/EOS, added tokens) and generation_config.json (EOS ids)."""
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        stmap = _read_json(os.path.join(path, "special_tokens_map.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
        tj, spm = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
        manual, by_fragment = True, False
        if os.path.isfile(tj):
            try:
                tok = HFTokenizer.from_file(tj)
            except Exception as e:  # tokenizers raises a bare Exception for bad JSON
                raise ModelLoadError(f"{tj}: cannot load tokenizer ({e})") from None
            manual = False
        elif os.path.isfile(spm):
            tok, by_fragment = _sentencepiece_tokenizer(spm)
        else:
            raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer.model in the model directory")

        _add_config_tokens(tok, tcfg, os.path.join(path, "added_tokens.json"), tj if not manual else spm)
        family = next((_FAMILY_TEXT[a] for a in model_cfg.get("architectures") or [] if a in _FAMILY_TEXT),
                      FamilyText())
        extra = list(extra_special_tokens) + list(family.special_tokens)
        extra += [_content(t) for t in tcfg.get("additional_special_tokens") or [] if _content(t)]
        if extra:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(extra)])

        special = {k: _content(tcfg.get(k, stmap.get(k))) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if family.eos_token:
            special["eos_token"] = family.eos_token
        bos_id = tok.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos_id is None:
            bos_id = model_cfg.get("bos_token_id")
        eos: list[int] = []
        if special["eos_token"] and tok.token_to_id(special["eos_token"]) is not None:
            eos.append(tok.token_to_id(special["eos_token"]))
        for src in (gen_cfg, model_cfg):
            v = src.get("eos_token_id")
            eos += v if isinstance(v, list) else ([v] if v is not None else [])

        add_bos_cfg, add_eos_cfg = tcfg.get("add_bos_token"), tcfg.get("add_eos_token")
        if manual:  # SentencePiece alone: LlamaTokenizer's default is to add BOS
            add_bos = True if add_bos_cfg is None else bool(add_bos_cfg)
            add_eos = bool(add_eos_cfg)
        else:
            # tokenizer.json's post-processor normally adds BOS itself. Older exports keep the flag only
            # in tokenizer_config.json; when the two disagree, the config wins (as in transformers) and
            # BOS is handled here instead of by the post-processor.
            pp_adds_bos = bos_id is not None and _post_processor_adds(tok, bos_id)
            add_bos, add_eos = pp_adds_bos, False
            if add_bos_cfg is not None and bool(add_bos_cfg) != pp_adds_bos:
                manual, add_bos = True, bool(add_bos_cfg)
        if (family.add_bos, family.add_eos) != (None, None):  # the family's serving code decides; BOS/EOS added here
            manual = True
            add_bos = add_bos if family.add_bos is None else family.add_bos
            add_eos = add_eos if family.add_eos is None else family.add_eos
        template = tcfg.get("chat_template")
        for fname in ("chat_template.jinja", "chat_template.json"):
            fp = os.path.join(path, fname)
            if template is None and os.path.isfile(fp):
                with open(fp, encoding="utf-8") as f:
                    template = f.read() if fname.endswith(".jinja") else json.load(f).get("chat_template")
        template = template or family.chat_template
        return cls(tok, bos_token_id=bos_id, eos_token_ids=dict.fromkeys(eos), add_bos=add_bos, add_eos=add_eos,
                   manual_special=manual, chat_template=template, special_tokens=special, name=path,
                   decode_by_fragment=by_fragment)

    @classmethod
    def from_gguf(cls, path_or_meta: Any) -> "Tokenizer":
        """From a .gguf path, its metadata dict, or anything with a `.metadata` dict (a `GGUFSource`)."""
        from ferrylm.weights.gguf import read_gguf_metadata

        if isinstance(path_or_meta, (str, os.PathLike)):
            name = os.fspath(path_or_meta)
            meta = read_gguf_metadata(name)
        else:
            meta = getattr(path_or_meta, "metadata", path_or_meta)
            name = getattr(path_or_meta, "path", "<gguf metadata>")
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(f"{name}: GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if model == "gpt2":
            tok = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [],
                                  meta.get("tokenizer.ggml.pre") or "default", name)
            add_bos_default = False
        elif model == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            tok = _spm_bpe(tokens, scores, types, bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                           tokens[unk] if unk is not None and unk < len(tokens) else None)
            add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise ModelLoadError(f"{name}: GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")

        def tok_str(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        return cls(tok, bos_token_id=bos, eos_token_ids=dict.fromkeys(e for e in eos if e is not None),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)), manual_special=True,
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens={"bos_token": tok_str("bos_token_id"), "eos_token": tok_str("eos_token_id"),
                                   "unk_token": tok_str("unknown_token_id"), "pad_token": tok_str("padding_token_id")},
                   vocab_size=len(tokens), name=name)

    # -- vocabulary -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size or self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids |= {i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None}
        return sorted(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    # -- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) become their ids.
        With `add_special_tokens`, BOS (and EOS) are added if the model's tokenizer config says so, but
        never a second BOS when the text already starts with it (chat templates often write it).
        `limit`: a long text of surely more tokens raises `TooManyTokensError` before its ids become a Python
        list (for a 15 MB prompt that list alone holds the GIL for a third of a second)."""
        special = add_special_tokens and not self._manual_special
        if len(text) > _GIL_FREE_CHARS:  # encode_batch drops the GIL, encode holds it (a server's loop would stall)
            enc = self._tok.encode_batch([text], add_special_tokens=special)[0]
            if limit is not None and len(enc) > limit + 2:  # +2: the BOS / EOS handling below moves it by one
                raise TooManyTokensError(len(enc), limit)
            ids = enc.ids
        else:
            ids = self._tok.encode(text, add_special_tokens=special).ids
        if add_special_tokens and self._manual_special:
            if self.add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        if add_special_tokens and len(ids) > 1 and ids[0] == ids[1] == self.bos_token_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if not self._fragment_breaks:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        # Encoding put a space prefix on every fragment between added tokens ("a<sep>b" -> a, <sep>, ▁b);
        # decoding each fragment alone drops it again, as the legacy LlamaTokenizer's decode does.
        parts, run = [], []
        for i in ids + [None]:
            if i is not None and i not in self._fragment_breaks:
                run.append(i)
                continue
            if run:
                parts.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            if i is not None:
                parts.append(self._tok.decode([i], skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def incremental_detokenizer(self, skip_special_tokens: bool = True,
                                prompt_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens, prompt_ids)

    # -- chat -------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default") or next(iter(self.chat_templates.values()), None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render the model's chat template the way transformers does (sandboxed Jinja, trim_blocks,
        lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`).

        A model without a template is an error (InvalidRequestError) rather than a guessed ChatML format:
        a wrong format silently degrades answers, while the error tells the user to send a raw prompt.
        """
        template = (self.chat_templates.get("tool_use") if tools else None) or self.chat_template
        if template is None:
            raise InvalidRequestError(
                f"the tokenizer of {self.name or 'this model'} has no chat template; send a plain prompt instead",
                param="messages")
        from jinja2.exceptions import TemplateError

        msgs = [{k: v for k, v in m.items() if v is not None} for m in _plain(messages)]
        variables = {**self.special_tokens, **_plain(kwargs), "messages": msgs, "tools": _plain(tools),
                     "add_generation_prompt": add_generation_prompt}
        variables.setdefault("documents", None)
        try:
            return _compile(template).render(**variables)
        # TemplateError includes the sandbox's SecurityError and raise_exception(); the others come from
        # templates doing arithmetic or lookups on values of the wrong type (e.g. integer content)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from None

    # -- internals --------------------------------------------------------------------------------

    def _end_of_turn_ids(self) -> frozenset[int]:
        text = "".join(self.chat_templates.values())
        ids = set()
        for tok in _END_OF_TURN:
            i = self._tok.token_to_id(tok)
            if i is not None and tok in text:
                ids.add(i)
        return frozenset(ids)


class IncrementalDetokenizer:
    """Ids in one at a time, text deltas out, without ever emitting half a UTF-8 character.

    vLLM's scheme: decode a short window ids[prefix_offset:] and compare it with the window's already
    emitted part ids[prefix_offset:read_offset]; emit the difference once it no longer ends in U+FFFD
    (an incomplete byte sequence), then slide the window. Decoding a window, not the whole sequence,
    keeps each step O(window) and still lets a token's text depend on its left neighbour.
    """

    _INITIAL_CONTEXT = 5  # prompt tokens kept in the window so the first delta decodes in context

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.prefix_offset = max(len(self.ids) - self._INITIAL_CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.text = ""
        """Everything emitted so far."""

    def add(self, token_id: int) -> str:
        """Feed one id; return the new text it completes (possibly "")."""
        self.ids.append(int(token_id))
        return self._step(final=False)

    def flush(self) -> str:
        """At the end of the stream: emit what is held back, even an incomplete character."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            delta = new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------

def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str, name: str) -> HFTokenizer:
    """GPT-2 style byte-level BPE from GGUF metadata; text split per llama.cpp's `tokenizer.ggml.pre`."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if pre not in _PRE_TOKENIZERS:
        warnings.warn(f"{name}: unknown GGUF pre-tokenizer {pre!r}; splitting text with llama.cpp's default regexes",
                      stacklevel=3)
        pre = "default"
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, tokens, types)
    return tok


def _spm_merges(tokens: list[str], scores: list[float], skip: set[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list: it merges the pair whose joined piece scores highest.
    Recover a ranked merge list from that: every split of a vocabulary piece into two pieces, best
    joined score first (ties: shorter left piece first, as transformers orders them)."""
    vocab = {t: i for i, t in enumerate(tokens) if i not in skip}
    cands = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                cands.append((-scores[i], len(left), len(right), vocab[left], vocab[right], left, right))
    cands.sort()
    return [(c[5], c[6]) for c in cands]


def _spm_bpe(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
             unk_token: str | None, remove_extra_whitespaces: bool = False,
             charsmap: bytes | None = None) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral, Yuan...) as a byte-fallback BPE, merging by
    score as SentencePiece and llama.cpp do (any merge list a file carries is not used)."""
    special = {i for i, ty in enumerate(types) if ty in (_CONTROL, _UNKNOWN, _USER_DEFINED, _UNUSED, _BYTE)}
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, special), unk_token=unk_token,
                                 fuse_unk=True, byte_fallback=True))
    _spm_text_handling(tok, add_space_prefix, remove_extra_whitespaces, charsmap)
    _add_typed_tokens(tok, tokens, types)
    return tok


def _spm_unigram(tokens, scores, types, unk_id, add_space_prefix, remove_extra_whitespaces, charsmap) -> HFTokenizer:
    """A SentencePiece unigram vocabulary (T5-like): pieces never cross a space."""
    tok = HFTokenizer(models.Unigram(list(zip(tokens, scores)), unk_id, True))
    _spm_text_handling(tok, add_space_prefix, remove_extra_whitespaces, charsmap)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_UNDERLINE, prepend_scheme="never", split=True)
    _add_typed_tokens(tok, tokens, types)
    return tok


def _spm_text_handling(tok: HFTokenizer, add_space_prefix: bool, remove_extra_whitespaces: bool,
                       charsmap: bytes | None) -> None:
    """SentencePiece's normalizer (charsmap, whitespace clean-up, dummy prefix, spaces as "▁") and the
    matching decoder.

    The prefix is prepended to every text fragment between special tokens, as llama.cpp and transformers'
    legacy LlamaTokenizer do ("a<sep>b" -> a, <sep>, ▁b); SentencePiece on its own would prefix only
    the start of the text.
    """
    norms = [normalizers.Precompiled(charsmap)] if charsmap else []
    if remove_extra_whitespaces:
        norms += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if add_space_prefix:
        norms.append(normalizers.Prepend(SPIECE_UNDERLINE))
    norms.append(normalizers.Replace(" ", SPIECE_UNDERLINE))
    tok.normalizer = normalizers.Sequence(norms)
    decs = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decs.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decs)


def _sentencepiece_tokenizer(model_file: str) -> tuple[HFTokenizer, bool]:
    """tokenizer.model (SentencePiece protobuf) -> (tokenizers.Tokenizer, whether text fragments get a space
    prefix), through the same builders as GGUF."""
    try:
        with open(model_file, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise ModelLoadError(f"{model_file}: cannot read ({e.strerror or e})") from None
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf

        proto = pb.ModelProto()
        proto.ParseFromString(blob)
        tokens = [p.piece for p in proto.pieces]
        scores = [p.score for p in proto.pieces]
        types = [p.type for p in proto.pieces]
        model_type = proto.trainer_spec.model_type  # 1 unigram, 2 bpe
        unk_id = proto.trainer_spec.unk_id
        add_prefix = proto.normalizer_spec.add_dummy_prefix
        remove_ws = proto.normalizer_spec.remove_extra_whitespaces
        charsmap = proto.normalizer_spec.precompiled_charsmap or None
    except ImportError:  # no protobuf: read pieces through sentencepiece, assume Llama-style BPE
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_proto=blob)
        n = sp.get_piece_size()
        tokens = [sp.id_to_piece(i) for i in range(n)]
        scores = [sp.get_score(i) for i in range(n)]
        types = [(_UNKNOWN if sp.is_unknown(i) else _CONTROL if sp.is_control(i) else _BYTE if sp.is_byte(i)
                  else _UNUSED if sp.is_unused(i) else _NORMAL) for i in range(n)]
        model_type, unk_id, add_prefix, remove_ws, charsmap = 2, sp.unk_id(), True, False, None
    except Exception as e:
        raise ModelLoadError(f"{model_file}: not a SentencePiece model ({e})") from None
    if not tokens:
        raise ModelLoadError(f"{model_file}: SentencePiece model has no pieces")
    if model_type == 1:
        return _spm_unigram(tokens, scores, types, unk_id, add_prefix, remove_ws, charsmap), add_prefix
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None
    return _spm_bpe(tokens, scores, types, add_prefix, unk, remove_ws, charsmap), add_prefix


def _add_typed_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control/unknown tokens become special added tokens, user-defined ones plain added tokens, so both
    are matched whole in text instead of being cut into pieces (llama.cpp does the same)."""
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _add_config_tokens(tok: HFTokenizer, tcfg: dict, added_json: str, where: str) -> None:
    """tokenizer_config.json's `added_tokens_decoder` and added_tokens.json, in id order, so that
    tokens beyond the base vocabulary get the ids the config gives them."""
    want: dict[int, AddedToken] = {}
    for sid, spec in (tcfg.get("added_tokens_decoder") or {}).items():
        if isinstance(spec, dict) and spec.get("content"):
            want[int(sid)] = AddedToken(spec["content"], special=bool(spec.get("special", True)),
                                        normalized=bool(spec.get("normalized", False)),
                                        lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                                        single_word=bool(spec.get("single_word", False)))
    for content, i in _read_json(added_json).items():
        want.setdefault(int(i), AddedToken(content, special=True, normalized=False))
    for i in sorted(want):
        t = want[i]
        if t.special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
        got = tok.token_to_id(t.content)
        if got != i:  # ids out of sequence: the token still works, under another id
            warnings.warn(f"{where}: added token {t.content!r} should have id {i} but got {got}", stacklevel=3)


def _post_processor_adds(tok: HFTokenizer, token_id: int) -> bool:
    try:
        return tok.encode("a", add_special_tokens=True).ids[:1] == [token_id]
    except Exception:
        return False


def _template_dict(t) -> dict[str, str]:
    """tokenizer_config's chat_template is a string or a list of {name, template}."""
    if not t:
        return {}
    if isinstance(t, str):
        return {"default": t}
    if isinstance(t, dict):
        return {str(k): v for k, v in t.items() if isinstance(v, str)}
    return {d["name"]: d["template"] for d in t if isinstance(d, dict) and "name" in d and "template" in d}


def _content(t) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t if isinstance(t, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------------
# Chat template sandbox
# ---------------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Rebuild template inputs out of plain JSON types: objects with methods never reach the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic (the server's request models)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_compiled: dict[str, Any] = {}


def _compile(template: str):
    if template not in _compiled:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): render the body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

            def _render(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            _compiled[template] = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise InvalidRequestError(f"the model's chat template does not parse: {e}", param="messages") from None
    return _compiled[template]
