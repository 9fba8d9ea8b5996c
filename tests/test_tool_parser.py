"""Tool-call parsers on text as the model families write it (no model needed)."""

from __future__ import annotations

import json

import pytest

from ferrylm.server.tool_parser import (HermesParser, Llama3JsonParser, MistralParser, get_parser, parse_required,
                                        required_schema)


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    p = HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    # unterminated last call (cut by a stop token) still parses; broken JSON stays text
    assert _calls(p.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')[1]) == [("f", {"x": 1})]
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert p.parse("no calls here") == ("no calls here", [])


def test_hermes_marker_holdback():
    p = HermesParser()
    assert p.call_starts_at("hello") == 5
    assert p.call_starts_at("hello <tool") == 6  # may become the marker: held back
    assert p.call_starts_at("hello <tool_call>{") == 6
    assert p.call_starts_at("a < b") == 5


def test_llama3_json():
    p = Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1]}}'
    assert _calls(p.parse(two)[1]) == [("a", {}), ("b", {"k": [1]})]
    assert p.parse("The answer is {x}") == ("The answer is {x}", [])
    assert p.parse('{"not": "a call"}') == ('{"not": "a call"}', [])
    assert p.call_starts_at("  {") == 0 and p.call_starts_at("Sure") == 4


def test_mistral():
    p = MistralParser()
    content, calls = p.parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert content is None and _calls(calls) == [("f", {"a": 1}), ("g", {})]
    assert p.parse("[TOOL_CALLS] nonsense") == ("[TOOL_CALLS] nonsense", [])


def test_required_schema_and_parse():
    class F:
        def __init__(self, name, parameters):
            self.name, self.parameters = name, parameters

    class T:
        def __init__(self, name, parameters=None):
            self.function = F(name, parameters)

    schema = required_schema([T("a", {"type": "object", "properties": {"x": {"type": "integer"}}}), T("b")])
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["a", "b"]
    assert _calls(parse_required('{"name": "a", "arguments": {"x": 3}}')) == [("a", {"x": 3})]
    assert parse_required("{oops") == []


def test_get_parser():
    assert get_parser(None) is None
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(KeyError):
        get_parser("nope")
