"""Tokenizer: GGUF-built vocabulary against transformers and llama.cpp facts, chat templates against
transformers, streaming detokenization, the template sandbox, and the SentencePiece / tokenizer.json
directory paths."""

from __future__ import annotations

import io
import json
import os
import random

import pytest

from ferrylm.default_model import default_model_path
from ferrylm.errors import InvalidRequestError, ModelLoadError
from ferrylm.tokenizer import IncrementalDetokenizer, Tokenizer
from ferrylm.weights.gguf import read_gguf_metadata
from helpers import vendor_encode, yuan_model_dir

TEXTS = [
    "Hello world! 123",
    "The capital of France is",
    "  multiple   spaces",
    "Café déjà vu.",
    "I'LL don't we've THEY'RE",
    "x 2024 y 3.14159 1,000,000",
    "def f(x):\n\treturn x**2  # comment\n\n\n",
    "tab\there\r\nwindows line",
    "日本語のテキスト 中文 한국어 العربية עברית",
    "emoji 😀👍🏽 🏳️\u200d🌈 👩\u200d👩\u200d👧",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "   ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke 😀"}],
]


@pytest.fixture(scope="module")
def smol_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(smol_path) -> Tokenizer:
    return Tokenizer.load(smol_path)


@pytest.fixture(scope="module")
def hf_tok(smol_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smol_path), gguf_file=os.path.basename(smol_path))


def test_round_trip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"  # specials skipped by default


def test_ids_match_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False), text


def test_ids_match_llama_cpp_facts(tok):
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one and keeps the space apart (Ġ = 216)
    assert tok.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.encode("Hello, we can use") == [19556, 28, 392, 416, 722]
    assert tok.encode("\n") == [198]


def test_special_ids(tok, smol_path):
    assert tok.bos_token_id == 1 and tok.add_bos is False  # SmolLM2's GGUF says add_bos_token = false
    assert tok.encode("hi")[0] != 1
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.vocab_size == 49152
    assert {0, 1, 2}.issubset(tok.all_special_ids)
    # a GGUFSource-like object (anything with .metadata) builds the same tokenizer without re-reading the file
    meta = read_gguf_metadata(smol_path)
    again = Tokenizer.from_gguf(type("Src", (), {"metadata": meta, "path": smol_path})())
    assert again.encode(TEXTS[4]) == tok.encode(TEXTS[4])


def test_chat_template_matches_transformers(tok, hf_tok):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = tok.apply_chat_template(conv, add_generation_prompt=gen)
            ref = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours == ref, (conv, gen)
    rendered = tok.apply_chat_template(CONVERSATIONS[0])
    assert rendered.endswith("<|im_start|>assistant\n")


def test_incremental_detokenizer_reproduces_decode(tok):
    text = "Grüße! 日本語 😀👍🏽 naïve café — “quotes” 🏳️\u200d🌈 end"
    ids = tok.encode(text)
    # the test only means something if some tokens carry a fraction of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for skip in (True, False):
        detok = tok.incremental_detokenizer(skip_special_tokens=skip)
        deltas = [detok.add(i) for i in ids]
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_incremental_detokenizer_after_prompt_and_specials(tok):
    prompt = tok.encode(tok.apply_chat_template(CONVERSATIONS[0]))
    out = tok.encode("Four 🎉 — final answer.") + [2]  # ends with <|im_end|>
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in out) + detok.flush()
    assert text == tok.decode(out) == "Four 🎉 — final answer."


def test_sandbox_refuses_malicious_templates(tok):
    refused = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",  # immutable: no mutating calls
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ]
    for template in refused:
        with pytest.raises(InvalidRequestError, match="unsafe"):
            Tokenizer(tok.backend, chat_template=template).apply_chat_template(CONVERSATIONS[0])
    # a bare unsafe attribute is an undefined value: it renders as nothing, never as the object
    for template in ("{{ ().__class__ }}", "{{ raise_exception.__globals__ }}"):
        assert Tokenizer(tok.backend, chat_template=template).apply_chat_template(CONVERSATIONS[0]) == ""


def test_template_helpers_and_missing_template(tok):
    t = Tokenizer(tok.backend, chat_template=(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|{{ tools | tojson }}"))
    out = t.apply_chat_template([{"role": "user", "content": "é <b>"}], tools=[{"name": "f"}])
    assert out == '{"role": "user", "content": "é <b>"}|4|[{"name": "f"}]'  # no HTML escaping, no ASCII escapes
    with pytest.raises(InvalidRequestError, match="one message only"):
        t.apply_chat_template(CONVERSATIONS[1])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template(CONVERSATIONS[0])


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        Tokenizer.load(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.load(str(tmp_path))


def test_tokenizer_json_directory(tok, tmp_path):
    """An HF directory: tokenizer.json + tokenizer_config.json + generation_config.json."""
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "add_bos_token": True,
        "chat_template": tok.chat_template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    d = Tokenizer.load(str(tmp_path))
    for text in TEXTS:
        assert d.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert d.encode("hi")[0] == 1  # add_bos_token from the config, though tokenizer.json has no post-processor
    assert d.encode("<|im_start|>hi").count(1) == 1  # never a double BOS
    assert d.eos_token_ids == {0, 2} and d.eos_token_id == 0
    assert d.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


# ---------------------------------------------------------------------------------------------------
# SentencePiece vocabularies: tokenizer.model directories (Llama 2, Yuan 2.0) and GGUF "llama" tokenizers
# ---------------------------------------------------------------------------------------------------

SPM_TEXTS = ["the quick brown fox", "Hello  world", " leading space", "über café 東京 😀 zzz", "fox\njumps\ttab",
             "  two  ", "unseen Ωmega 42"]


def _train_spm(**kw) -> bytes:
    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    words = ("the quick brown fox jumps over lazy dog hello world model token byte fallback sentence piece "
             "merges ranked score café naïve 東京 über straße").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, control_symbols=["<eod>"],
                                   user_defined_symbols=["<sep>"], minloglevel=2, **kw)
    return out.getvalue()


@pytest.mark.parametrize("llama_style", [True, False])
def test_sentencepiece_directory_matches_sentencepiece(tmp_path, llama_style):
    import sentencepiece as spm

    kw = dict(normalization_rule_name="identity", remove_extra_whitespaces=False) if llama_style else {}
    blob = _train_spm(**kw)
    (tmp_path / "tokenizer.model").write_bytes(blob)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["YuanForCausalLM"], "eos_token_id": 3}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<eod>"}))
    sp = spm.SentencePieceProcessor(model_proto=blob)
    t = Tokenizer.load(str(tmp_path))
    for text in SPM_TEXTS:
        assert t.encode(text) == sp.encode(text), text
        assert t.decode(t.encode(text)) == sp.decode(sp.encode(text))
    eod = sp.piece_to_id("<eod>")
    assert t.eos_token_id == eod and t.eos_token_ids == {eod, 3}
    # Yuan's extra special tokens: appended after the SentencePiece vocabulary, matched whole
    sep, pad = t.token_to_id("<sep>"), t.token_to_id("<FIM_MIDDLE>")
    assert sep == sp.piece_to_id("<sep>") and pad >= sp.get_piece_size()
    ids = t.encode("a<FIM_MIDDLE>b")
    assert pad in ids and t.decode(ids, skip_special_tokens=False).replace(" ", "") == "a<FIM_MIDDLE>b"


def test_gguf_llama_sentencepiece_vocabulary():
    """A GGUF `llama` (SentencePiece) tokenizer, from metadata only: scores-ranked merges, byte fallback."""
    import sentencepiece as spm

    blob = _train_spm(normalization_rule_name="identity", remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_proto=blob)
    n = sp.get_piece_size()
    ttype = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    ttype[sp.piece_to_id("<sep>")] = 4  # user-defined
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": ttype,
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}
    t = Tokenizer.from_gguf(meta)
    for text in SPM_TEXTS:
        assert t.encode(text) == [sp.bos_id()] + sp.encode(text), text  # llama vocabularies add BOS by default
    assert t.decode(t.encode("über 😀")) == "über 😀"
    detok = t.incremental_detokenizer()
    ids = t.encode(" fox 😀 über")
    assert "".join(detok.add(i) for i in ids) + detok.flush() == t.decode(ids)


# ---------------------------------------------------------------------------------------------------
# Yuan 2.0 as its vendor serves it (tests/data/yuan2-tokenizer/golden_encodings.json says how the ids were made)
# ---------------------------------------------------------------------------------------------------

YUAN_GOLDEN = os.path.join(os.path.dirname(__file__), "data", "yuan2-tokenizer", "golden_encodings.json")
YUAN_TEXTS = ["Write a short story about spring.<sep>", "你好<sep>", "Hello<sep>你好<sep>", "a <sep> b<eod>",
              "def add(a, b):\n    return a + b\n<sep>", "  two  spaces\t<n><eod>", "<sep><sep>x", "<eod>",
              "用户：你好<sep>助手：你好！有什么可以帮你？<eod>", "<FIM_PREFIX>def<FIM_SUFFIX>x<FIM_MIDDLE>"]


def test_yuan_vendor_tokenizer_matches_golden_encodings(yuan_vendor_tokenizer_dir, tmp_path):
    import sentencepiece as spm

    with open(YUAN_GOLDEN, encoding="utf-8") as f:
        golden = json.load(f)
    # the real checkpoints' config lists <eod> as eos; this one lists nothing: <eod> must still end text
    t = Tokenizer.load(yuan_model_dir(tmp_path, yuan_vendor_tokenizer_dir))
    for tok, i in golden["special_token_ids"].items():
        assert t.token_to_id(tok) == i, tok
    for case in golden["cases"]:
        ids = t.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert t.decode(ids, skip_special_tokens=False) == case["text"]
    assert t.eos_token_id == golden["eos_token_id"] == 77185 and t.eos_token_ids == {77185}
    assert not t.add_bos and not t.add_eos  # tokenizer_config.json asks for both; the vendor turns them off
    sp = spm.SentencePieceProcessor(model_file=os.path.join(yuan_vendor_tokenizer_dir, "tokenizer.model"))
    for text in YUAN_TEXTS + SPM_TEXTS:
        assert t.encode(text) == vendor_encode(sp, golden["special_token_ids"], text), text


def test_yuan_like_tokenizer_follows_the_vendor_rules(yuan_like_tokenizer_dir, tmp_path):
    """The same rules on a small Yuan-style vocabulary (runs where the vendor's files are absent)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(yuan_like_tokenizer_dir, "tokenizer.model"))
    t = Tokenizer.load(yuan_model_dir(tmp_path, yuan_like_tokenizer_dir, eos_token_id=7))
    eod = sp.piece_to_id("<eod>")
    assert eod != sp.unk_id() and not sp.is_control(eod)  # a plain piece, as in the real vocabulary
    specials = {s: t.token_to_id(s) for s in ("<eod>", "<sep>", "<pad>", "<FIM_PREFIX>", "<FIM_SUFFIX>", "<FIM_MIDDLE>")}
    assert specials["<eod>"] == eod and specials["<sep>"] == sp.piece_to_id("<sep>")
    for text in YUAN_TEXTS + SPM_TEXTS:
        ids = t.encode(text)
        assert ids == vendor_encode(sp, specials, text), text
        assert t.decode(ids, skip_special_tokens=False) == text
    assert t.encode("x<eod>") == sp.encode("x") + [eod]  # one token, no BOS (1), no </s> (2)
    assert t.eos_token_id == eod and t.eos_token_ids == {eod, 7}  # <eod> and the config's end ids
    assert t.decode(t.encode("你好<sep>世界<eod>")) == "你好世界"  # specials skipped, no prefix space left over
    # an answer streamed after the prompt's <sep> starts without the space prefix its first piece carries
    prompt = t.encode("hello<sep>")
    detok = t.incremental_detokenizer(prompt_ids=prompt)
    answer = t.encode("world model<eod>")
    assert "".join(detok.add(i) for i in answer) + detok.flush() == "world model"


YUAN_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
             {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Explain"}]


def test_yuan_chat_format(yuan_like_tokenizer_dir, tmp_path):
    """FastChat's `yuan2` conversation: system + "\\n", turns joined by "<n>", then <sep>; newlines inside a
    message stay newlines; a last message ending in "n" keeps it (FastChat's rstrip("<n>") would eat it)."""
    t = Tokenizer.load(yuan_model_dir(tmp_path, yuan_like_tokenizer_dir))
    assert t.apply_chat_template(YUAN_CHAT) == "Be brief.\nHi\nthere<n>Hello! How can I help?<n>Explain<sep>"
    assert t.apply_chat_template(YUAN_CHAT[1:2]) == "Hi\nthere<sep>"
    assert t.apply_chat_template(YUAN_CHAT[:3], add_generation_prompt=False) == "Be brief.\nHi\nthere<n>Hello! How can I help?"
    ids = t.encode(t.apply_chat_template(YUAN_CHAT[1:2]))
    assert ids[-1] == t.token_to_id("<sep>") and ids.count(t.token_to_id("<sep>")) == 1
    # a directory's own template wins over the family's
    d = yuan_model_dir(tmp_path, yuan_like_tokenizer_dir)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    os.unlink(os.path.join(d, "tokenizer_config.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({**cfg, "chat_template": "{{ messages[-1]['content'] }}!"}, f)
    assert Tokenizer.load(d).apply_chat_template(YUAN_CHAT) == "Explain!"
