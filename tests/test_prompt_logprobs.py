"""Prompt logprobs (`SamplingParams.prompt_logprobs`) on the embedded SmolLM2 against a plain full-sequence
forward of transformers over the same GGUF in fp32: at every prompt position, the logprob of the next prompt
token and the top-n, with chunked prefill (a small `max_num_batched_tokens`), in a batch with rows that do
not ask, for a prompt whose prefix an earlier request left in the prefix cache, and under preemption."""

import pytest
import torch

from ferrylm import LLM, SamplingParams

CHUNK = 16
"""Step budget: the prompts below are prefilled in 3-5 chunks."""
TOL = 1e-3
"""fp32 on both sides; measured max difference ~2e-5 (printed)."""
TOP = 3


@pytest.fixture(scope="module")
def llm():
    """The plain fp32 path (weights dequantized at load), chunked prefill, prefix caching on (the default)."""
    return LLM(dequantize=True, max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=256)


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    model = hf_smollm2

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()  # [S, V]
        return torch.log_softmax(logits, dim=-1)  # [S, V]
    return logprobs


TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold; fortune favours the bold, and actions speak louder than words. "
        "The early bird catches the worm.")


def check(ids: list[int], got: list, ref: torch.Tensor, n: int) -> float:
    """`got` (the engine's prompt logprobs) against the reference log_softmax [S, V]; the max difference."""
    assert len(got) == len(ids) and got[0] is None
    worst = 0.0
    for i in range(1, len(ids)):
        d, row = got[i], ref[i - 1]  # position i - 1's logits predict token i
        assert ids[i] in d and max(n, 1) <= len(d) <= n + 1  # the prompt token's own, and the top-n
        for t, v in d.items():
            worst = max(worst, abs(v - row[t].item()))
        # the n highest entries are the reference's top-n (compared by value: near-ties may swap ids)
        assert sorted(d.values(), reverse=True)[:n] == pytest.approx(row.topk(n)[0].tolist(), abs=TOL)
    return worst


def test_prompt_logprobs_equal_a_full_forward_with_chunked_prefill(llm, reference):
    tok = llm.tokenizer
    prompts = [tok.encode(TEXT), tok.encode("Paris is the capital of France, and Berlin is the capital of Germany."),
               tok.encode(TEXT[:90])]
    assert len(prompts[0]) > 2 * CHUNK
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate(prompts, [asks, plain, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)])
    assert outs[1].prompt_logprobs is None
    worst = check(prompts[0], outs[0].prompt_logprobs, reference(prompts[0]), TOP)
    worst = max(worst, check(prompts[2], outs[2].prompt_logprobs, reference(prompts[2]), 0))
    assert all(len(d) == 1 for d in outs[2].prompt_logprobs[1:])  # 0: only the prompt token's own
    print(f"prompt logprobs vs transformers (chunks of {CHUNK} tokens): max |diff| {worst:.2e}")
    assert worst < TOL
    # asking changes nothing about the generated tokens
    assert outs[0].outputs[0].token_ids == llm.generate([prompts[0]], plain)[0].outputs[0].token_ids


def test_prompt_ranks_equal_a_full_forward(llm, reference):
    """Each prompt token's rank (1 + the tokens with a higher logit) against the reference's, within the
    tokens whose reference logprob lies within TOL of the token's (fp32 near-ties may order either way)."""
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    ref = reference(ids)
    assert len(out.prompt_ranks) == len(ids) and out.prompt_ranks[0] is None
    ranks = out.prompt_ranks[1:]
    for i, rank in enumerate(ranks, 1):
        row, v = ref[i - 1], ref[i - 1][ids[i]]
        assert int((row > v + TOL).sum()) + 1 <= rank <= int((row > v - TOL).sum()) + 1, (i, rank)
        assert (rank == 1) == (max(out.prompt_logprobs[i].values()) == out.prompt_logprobs[i][ids[i]])
    assert 1 in ranks and max(ranks) > 100  # the text has tokens the model predicts and tokens it does not


def test_prompt_logprobs_of_a_prompt_whose_prefix_is_cached(llm, reference):
    tok = llm.tokenizer
    prefix = tok.encode(TEXT)
    ids = prefix + tok.encode(" Every cloud has a silver lining.")
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prefix], plain)  # leaves the prefix's full blocks in the cache
    hit = llm.generate([ids], plain)[0]
    assert hit.num_cached_tokens >= 32  # the cache does serve this prefix
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP))[0]
    assert out.num_cached_tokens == 0  # a request that asks computes its whole prompt
    worst = check(ids, out.prompt_logprobs, reference(ids), TOP)
    print(f"prompt logprobs with a cached prefix: max |diff| {worst:.2e}")
    assert worst < TOL


def test_prompt_logprobs_survive_preemption(reference):
    """A KV pool too small for the batch preempts sequences (recompute, prompt and outputs again): each
    position is recorded once, and the values are still the full forward's."""
    small = LLM(dequantize=True, max_num_seqs=4, max_num_batched_tokens=CHUNK, block_size=4, num_kv_blocks=40,
                max_model_len=128)
    tok = small.tokenizer
    words = TEXT.split()
    prompts = [tok.encode(" ".join(words[i:i + 24])) for i in (0, 5, 10, 15)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    outs = small.generate(prompts, sp)
    preemptions = small.engine.scheduler.num_preemptions
    assert preemptions > 0, "the small pool should have forced a preemption"
    worst = max(check(p, o.prompt_logprobs, reference(p), 2) for p, o in zip(prompts, outs))
    print(f"prompt logprobs with {preemptions} preemptions: max |diff| {worst:.2e}")
    assert worst < TOL
    small.close()
