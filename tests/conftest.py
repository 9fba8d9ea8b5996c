import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests import helpers.py

if os.environ.get("FERRY_TEST_TRACE"):  # set by benchmarks/gpu_tests.sh: a group killed by its timeout keeps
    import time                          # what it learnt (start times, each failure as it happens)

    def pytest_runtest_logstart(nodeid, location):
        print(f"\n[{time.strftime('%H:%M:%S')}] start {nodeid}", flush=True)

    def pytest_runtest_logreport(report):
        if report.failed:
            print(f"\n[{time.strftime('%H:%M:%S')}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}",
                  flush=True)
        elif report.when == "call":
            print(f"\n[{time.strftime('%H:%M:%S')}] {report.outcome} {report.nodeid} in {report.duration:.1f}s",
                  flush=True)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the embedded default GGUF (fp32, eval mode), the reference of test_gguf,
    test_prompt_logprobs and test_smollm2. It dequantizes the file in Python (~35 s on the 2-core box), so
    once a session; the tests only read it."""
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    transformers = pytest.importorskip("transformers")
    import torch

    from ferrylm.default_model import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random-weight Llama checkpoint (no tokenizer files), as transformers writes it."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    from helpers import save_random

    return save_random(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp("tiny-llama"), 0.1)


# -- Yuan 2.0 tokenizer files -----------------------------------------------------------------------------

YUAN_TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def yuan_vendor_tokenizer_dir() -> str:
    """The vendor's real Yuan2.0 tokenizer files (2.1 MB, not ours to ship): $FERRY_YUAN_TOKENIZER, or
    shared/golden/yuan2-tokenizer in a folder above this checkout; skipped where neither exists (CI)."""
    found = os.environ.get("FERRY_YUAN_TOKENIZER")
    d = os.path.dirname(os.path.abspath(__file__))
    while not found and os.path.dirname(d) != d:
        d = os.path.dirname(d)
        cand = os.path.join(d, "shared", "golden", "yuan2-tokenizer")
        found = cand if os.path.isdir(cand) else None
    if not found or not all(os.path.isfile(os.path.join(found, f)) for f in YUAN_TOKENIZER_FILES):
        pytest.skip("the vendor's Yuan2.0 tokenizer files are not here: set FERRY_YUAN_TOKENIZER to a folder with "
                    + ", ".join(YUAN_TOKENIZER_FILES))
    return found


@pytest.fixture(scope="session")
def yuan_like_tokenizer_dir(tmp_path_factory) -> str:
    """A small SentencePiece BPE built the way Yuan2.0's is (byte fallback, identity normalization, <eod>,
    <sep> and <n> as plain pieces, <s> </s> control), with a tokenizer_config.json that asks for BOS and EOS
    as the vendor's does: the vendor's serving rules can be checked where its files are absent."""
    import io
    import json
    import random

    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    rng = random.Random(0)
    words = ("write a short story about spring hello world def add return code the model token 你好 北京 "
             "上海 冬天 很 冷 用户 助手 有什么 可以 帮你").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, user_defined_symbols=["<eod>", "<n>", "<sep>"],
                                   minloglevel=2)
    proto = pb.ModelProto()
    proto.ParseFromString(out.getvalue())
    for p in proto.pieces:
        if p.piece in ("<eod>", "<n>", "<sep>"):
            p.type = pb.ModelProto.SentencePiece.NORMAL  # as in Yuan's tokenizer.model
    d = tmp_path_factory.mktemp("yuan-like-tokenizer")
    (d / "tokenizer.model").write_bytes(proto.SerializeToString())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "LlamaTokenizer"}))
    return str(d)


@pytest.fixture(autouse=True)
def _host_dense_gemm():
    """The hybrid calibration sets `layers/cpu_experts.dense_gemm` / `packed_gemm` process-wide: no test leaks
    its choice."""
    from ferrylm.layers import cpu_experts

    names = tuple(f"{k}{s}" for k in ("dense_gemm", "packed_gemm", "row_blocks_gemm") for s in ("", "_max_t", "_multi"))
    before = [getattr(cpu_experts, n) for n in names]
    yield
    for n, v in zip(names, before):
        setattr(cpu_experts, n, v)
