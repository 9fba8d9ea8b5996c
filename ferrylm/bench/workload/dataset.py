"""Prompts from a file: JSONL with one request per line, or ShareGPT-format JSON.

JSONL rows: {"prompt": "..."} or {"text": "..."} or {"messages": [{"role", "content"}, ...]}, with an
optional "max_tokens" (or "output_len"). ShareGPT rows (a JSON list, or JSONL): {"conversations":
[{"from": "human", "value"}, {"from": "gpt", "value"}, ...]}: the first human turn is the prompt and the
reply that follows sets max_tokens (its token count). Rows without a usable prompt are skipped; a file with
none, or a line that is not JSON, is an error naming the file and line. Does not know HTTP.
"""

from __future__ import annotations

import json
import os
import random

from ferrylm.bench import BenchError
from ferrylm.bench.workload.prompts import Prompt
from ferrylm.bench.workload.tokens import TokenCounter

_HUMAN, _BOT = ("human", "user"), ("gpt", "assistant", "chatgpt", "bard", "model")


def _rows(path: str) -> list:
    if not os.path.isfile(path):
        raise BenchError(f"dataset {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise BenchError(f"dataset {path}: not valid JSON ({e})") from None
        return rows
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BenchError(f"dataset {path}:{no}: not valid JSON ({e.msg})") from None
    return rows


def _prompt(row, counter: TokenCounter) -> Prompt | None:
    if not isinstance(row, dict):
        return None
    max_tokens = row.get("max_tokens", row.get("output_len"))
    messages = None
    if isinstance(row.get("conversations"), list):
        turns = [t for t in row["conversations"] if isinstance(t, dict) and isinstance(t.get("value"), str)]
        first = next((i for i, t in enumerate(turns) if t.get("from") in _HUMAN), None)
        if first is None:
            return None
        text = turns[first]["value"]
        reply = turns[first + 1] if first + 1 < len(turns) and turns[first + 1].get("from") in _BOT else None
        if max_tokens is None and reply is not None and reply["value"].strip():
            max_tokens = counter.count(reply["value"])
    elif isinstance(row.get("messages"), list):
        messages = tuple({"role": m.get("role", "user"), "content": m.get("content", "")}
                         for m in row["messages"] if isinstance(m, dict))
        text = "\n".join(str(m["content"]) for m in messages)
    else:
        text = row.get("prompt", row.get("text"))
    if not isinstance(text, str) or not text.strip():
        return None
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens > 0):
        max_tokens = None
    return Prompt(text, "dataset", counter.count(text), max_tokens, messages)


def load_dataset(path: str, n: int, counter: TokenCounter, seed: int) -> list[Prompt]:
    """Up to n prompts, in an order fixed by the seed."""
    rows = _rows(path)
    if not isinstance(rows, list):
        raise BenchError(f"dataset {path}: expected a JSON list or JSON lines")
    random.Random(seed).shuffle(rows)
    out = []
    for row in rows:
        if len(out) == n:
            break
        p = _prompt(row, counter)
        if p is not None:
            out.append(p)
    if not out:
        raise BenchError(f"dataset {path}: no row with a prompt (expected prompt, text, messages or conversations)")
    return out
