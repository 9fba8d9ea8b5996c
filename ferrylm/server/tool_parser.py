"""Tool calls: reading them out of generated text, and the JSON schema that forces one.

Owns: the parsers for the common formats, chosen by `ferry serve --tool-call-parser`
(hermes: Hermes / Qwen `<tool_call>{...}</tool_call>`; llama3_json: Llama 3's bare `{"name", "parameters"}`
JSON, optionally after `<|python_tag|>`; mistral: `[TOOL_CALLS][{...}, ...]`), and the schema the sampler's
grammar follows when `tool_choice` is `required` or names a function (then no parser is needed: the
output is the call). Does not know HTTP, the engine or the OpenAI response shapes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI sends a string)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _call(obj) -> ToolCall | None:
    """A call from {"name", "arguments" | "parameters"}; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Splits model text into (content before the calls, calls). Text that does not parse stays content."""

    name = ""
    start = ""
    """The marker that opens a call: streamed text holds back anything that may be its beginning."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def call_starts_at(self, text: str) -> int:
        """Index where a call (or what may become its marker) begins in `text`; len(text) if none."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):  # a marker cut at the end of the text
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesParser(ToolParser):
    name, start = "hermes", "<tool_call>"
    _re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for m in self._re.finditer(text, at):
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:at].strip() or None), calls


class Llama3JsonParser(ToolParser):
    name, start = "llama3_json", "{"

    def call_starts_at(self, text):
        # only a JSON object at the very start of the answer is a call
        stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, dec, i = [], json.JSONDecoder(), 0
        try:
            while i < len(body):
                obj, i = dec.raw_decode(body, i)
                call = _call(obj)
                if call is None:
                    return text, []
                calls.append(call)
                while i < len(body) and body[i] in " \n\t;":
                    i += 1
        except ValueError:
            return text, []
        return None, calls


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def parse(self, text):
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[at + len(self.start):].lstrip())
        except ValueError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(o) for o in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return (text[:at].strip() or None), calls


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str | None) -> ToolParser | None:
    return PARSERS[name]() if name else None


# -- forced calls ----------------------------------------------------------------------------------

def arguments_schema(tool) -> dict:
    """The schema of one function's arguments (a named tool_choice: the output is the arguments)."""
    return tool.function.parameters or {"type": "object"}


def required_schema(tools) -> dict:
    """tool_choice=required: the output is one JSON object {"name": one of the tools, "arguments": {...}}."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                        "arguments": arguments_schema(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def parse_required(text: str) -> list[ToolCall]:
    try:
        call = _call(json.loads(text))
    except ValueError:
        return []
    return [call] if call else []
