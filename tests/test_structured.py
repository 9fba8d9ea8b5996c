"""Structured outputs through the offline API on the embedded model: the llguidance mask in the sampler.

Every sample must match its constraint; a constrained greedy run must equal the unconstrained greedy run
while the unconstrained output happens to satisfy the constraint (the mask then removes nothing that matters).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.errors import InvalidRequestError  # noqa: E402
from ferrylm.sampling_params import StructuredOutput  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    return LLM(max_model_len=256, max_num_seqs=16)


def test_regex_and_choice_samples_match(llm):
    so = StructuredOutput("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3}")
    outs = llm.generate(["Name and age:"], SamplingParams(n=8, seed=3, temperature=1.0, max_tokens=20, structured=so))
    for c in outs[0].outputs:
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", c.text) and c.finish_reason == "stop", c
    choice = StructuredOutput("choice", ["alpha", "beta gamma"])
    outs = llm.generate({"prompt": "Pick:"}, SamplingParams(n=8, seed=1, max_tokens=10, structured=choice))
    assert {c.text for c in outs[0].outputs} <= {"alpha", "beta gamma"}


def test_json_schema_with_n_and_dict_prompts(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    ids = llm.tokenizer.encode("A JSON status:")
    outs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=6, seed=9, max_tokens=40,
                                                                    structured=StructuredOutput("json", schema)))
    assert outs[0].prompt_token_ids == ids
    for c in outs[0].outputs:
        obj = json.loads(c.text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and type(obj["n"]) is int and obj["n"] <= 99


def test_mask_is_neutral_where_the_free_output_already_fits(llm):
    free = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    # a regex that the free greedy text matches from its start: the constrained greedy run is the same text
    so = StructuredOutput("regex", re.escape(free.text) + ".*")
    fixed = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6, structured=so))
    assert fixed[0].outputs[0].text == free.text


def test_bad_constraints_are_named(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(structured=StructuredOutput("regex", "[0-9")))
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(structured=StructuredOutput("json", {"type": "nonsense"})))
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        llm.generate({"text": "x"})
