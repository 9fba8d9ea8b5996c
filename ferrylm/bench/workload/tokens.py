"""`TokenCounter`: how many tokens a text is, asked of the server when it can say, else of a local tokenizer,
else estimated. Used only to fit prompt lengths before a run; the summary's token figures come from the
server's `usage`.

Server dialects: vLLM and ferrylm answer `POST /tokenize {"model", "prompt"}` with `count` / `tokens`;
llama.cpp answers `POST /tokenize {"content"}` with `tokens`. Does not know prompts or requests.
"""

from __future__ import annotations

import math
import re

import httpx

from ferrylm.bench import BenchError

_CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")


class TokenCounter:
    name = "estimate (1 token per CJK character, 4 other characters per token)"

    def count(self, text: str) -> int:
        cjk = len(_CJK.findall(text))
        return cjk + math.ceil((len(text) - cjk) / 4)


class ServerCounter(TokenCounter):
    def __init__(self, http: httpx.Client, body):
        self.http, self.body = http, body
        self.name = f"server POST /tokenize ({'vLLM/ferrylm' if 'prompt' in body('') else 'llama.cpp'} dialect)"

    def count(self, text: str) -> int:
        r = self.http.post("/tokenize", json=self.body(text))
        if r.status_code != 200:
            raise BenchError(f"/tokenize failed with HTTP {r.status_code}: {r.text[:200]}")
        return _tokens_in(r.json())


class LocalCounter(TokenCounter):
    def __init__(self, path: str):
        from ferrylm.errors import ModelLoadError
        from ferrylm.tokenizer import Tokenizer

        try:
            if path.endswith(".json"):
                from tokenizers import Tokenizer as HF

                hf = HF.from_file(path)
                self._encode = lambda t: hf.encode(t, add_special_tokens=False).ids
            else:
                tok = Tokenizer.load(path)
                self._encode = lambda t: tok.encode(t, add_special_tokens=False)
        except (ModelLoadError, OSError, Exception) as e:  # noqa: BLE001 - any reason it cannot load is the same to the user
            raise BenchError(f"cannot load tokenizer {path}: {e}") from None
        self.name = f"local tokenizer {path}"

    def count(self, text: str) -> int:
        return len(self._encode(text))


def _tokens_in(body: dict) -> int:
    if isinstance(body.get("count"), int):
        return body["count"]
    if isinstance(body.get("tokens"), list):
        return len(body["tokens"])
    raise BenchError(f"/tokenize answered without `count` or `tokens`: {str(body)[:200]}")


def make_counter(http: httpx.Client, model: str | None, tokenizer: str | None) -> TokenCounter:
    """A local tokenizer when given (it is what the user asked for), else the server's /tokenize, else the estimate."""
    if tokenizer:
        return LocalCounter(tokenizer)
    dialects = [lambda t: {"prompt": t, **({"model": model} if model else {})}, lambda t: {"content": t}]
    for body in dialects:
        try:
            r = http.post("/tokenize", json=body("hello world"))
            # llama.cpp answers a body without `content` with 200 and no tokens: a dialect must count something
            if r.status_code == 200 and _tokens_in(r.json()) > 0:
                return ServerCounter(http, body)
        except (httpx.HTTPError, ValueError, BenchError):
            continue
    return TokenCounter()
