"""`ferry export-tokenizer DIR`: benchmark tools load DIR with transformers and count tokens as the server does."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def test_exported_tokenizer_matches(tmp_path):
    from ferrylm.cli import main
    from ferrylm.default_model import default_model_path
    from ferrylm.tokenizer import Tokenizer

    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = Tokenizer.load(default_model_path())
    for text in ("Hello world, café! 123", "<|im_start|>user\nHi<|im_end|>", "  spaces\tand\nnewlines  "):
        assert hf.encode(text) == ours.encode(text), text
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text), skip_special_tokens=False)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)
