"""Test helpers: capture the logits the engine samples from, per sequence, in step order; Yuan text-side
directories and the vendor's encoding recipe; a byte-level tokenizer for random-weight checkpoints; a
transformers model saved with random normal weights."""

import contextlib
import json
import os
import re


class _Recorder:
    """Stands in front of the engine's real sampler, records each row, then samples with it."""

    def __init__(self, inner, got: list):
        self._inner, self._got = inner, got

    def __call__(self, logits, seqs, *args):
        for row, s in zip(logits, seqs):
            self._got.append((s.seq_id, row.detach().clone()))
        return self._inner(logits, seqs, *args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def capture_logits(engine):
    """Yields a list that fills with (seq_id, logits row [V]) for every sampled row."""
    got: list = []
    real = engine.sampler
    engine.sampler = _Recorder(real, got)
    try:
        yield got
    finally:
        engine.sampler = real


def byte_tokenizer(path: str) -> None:
    """tokenizer.json of 256 byte-level tokens (ids 0..255), so prompts, stops and the server can be text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))


def yuan_model_dir(tmp_path, tokenizer_dir: str, **config) -> str:
    """A Yuan model directory's text side: the tokenizer files plus a config.json naming the architecture."""
    d = tmp_path / "yuan"
    d.mkdir(exist_ok=True)
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(tokenizer_dir, f)) and not (d / f).exists():
            os.symlink(os.path.join(tokenizer_dir, f), d / f)
    (d / "config.json").write_text(json.dumps({"architectures": ["YuanForCausalLM"], **config}))
    return str(d)


def vendor_encode(sp, specials: dict[str, int], text: str) -> list[int]:
    """The vendor's slow LlamaTokenizer (legacy): split on special tokens, SentencePiece on each chunk, no BOS/EOS."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        ids += [specials[part]] if part in specials else sp.encode(part) if part else []
    return ids


def save_random(model, path, std: float) -> str:
    """Every matrix of a transformers `model` drawn from N(0, std) (torch's global generator), then
    `save_pretrained` to `path` (real tensor names); returns the path as a string."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(path)
    return str(path)


def triton_device() -> bool:
    """Skip the calling test module (or test) unless Triton's kernels can run here: on CUDA, or on the CPU
    under Triton's interpreter (`TRITON_INTERPRET=1` set before Python starts; fp32 only). Returns whether
    CUDA is the device."""
    import pytest
    import torch

    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
    return cuda
