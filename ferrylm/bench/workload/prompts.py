"""`Prompt` and the synthetic prompt generator: text of a target token length in a chosen kind
(en, zh, code, math), drawn from the built-in corpus.

A prompt is the drawn sentences followed by the kind's task line (left out of prompts under twice its length). Its length is fitted with a
`TokenCounter`: a few secant steps on the number of characters (cut at a word boundary, or any character
for Chinese) until the count hits the target or stops moving, keeping the closest. Does not know HTTP.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass

from ferrylm.bench.workload.corpus import KINDS
from ferrylm.bench.workload.tokens import TokenCounter

SEPARATOR = "\n\n"
"""Between the drawn text and the task line."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """The prompt (completions) or the user message (chat)."""
    kind: str
    """en / zh / code / math, or `dataset`."""
    tokens: int
    """Its length as the counter saw it (the summary uses the server's usage instead when it has one)."""
    max_tokens: int | None = None
    """A dataset row's own output budget."""
    messages: tuple | None = None
    """A dataset row's whole conversation (chat API), when it had one."""


def synthetic_prompts(n: int, lengths: tuple[int, int], mix: tuple[tuple[str, float], ...], counter: TokenCounter,
                      seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    kinds, weights = zip(*mix)
    fitter = _Fitter(counter)
    return [fitter.fit(k, rng.randint(*lengths), rng) for k in rng.choices(kinds, weights, k=n)]


class _Fitter:
    def __init__(self, counter: TokenCounter):
        self.counter = counter
        self.per_char: dict[str, float] = {}
        """Tokens per character of each kind's corpus, measured once."""
        self.tail: dict[str, tuple[str, int]] = {}

    def fit(self, kind: str, target: int, rng: random.Random) -> Prompt:
        sentences, task, sep = KINDS[kind]
        if kind not in self.per_char:
            whole = sep.join(sentences)
            self.per_char[kind] = max(self.counter.count(whole), 1) / len(whole)
        rate = self.per_char[kind]
        if kind not in self.tail:  # a task line longer than half the prompt would crowd it out: then none
            self.tail[kind] = (SEPARATOR + task, self.counter.count(SEPARATOR + task))
        tail, tail_tokens = self.tail[kind]
        if tail_tokens > target / 2:
            tail, tail_tokens = "", 0
        body = self._draw(sentences, sep, int(1.5 * target / rate) + 400, rng)
        # cut points: word starts, or every character for text without spaces (Chinese)
        cuts = [0] + [m.start() for m in re.finditer(r"(?<=\s)\S", body)] if " " in body else list(range(len(body)))
        cuts.append(len(body))

        def text_at(i: int) -> str:
            return body[:cuts[i]].rstrip() + tail

        i = bisect.bisect(cuts, (target - tail_tokens) / rate)
        i = min(max(i, 1), len(cuts) - 1)
        best, seen = None, set()
        for _ in range(8):
            n = self.counter.count(text_at(i))
            if best is None or abs(n - target) < abs(best[1] - target):
                best = (i, n)
            seen.add(i)
            if n == target:
                break
            # secant step in characters, at least one cut point
            step_chars = (target - n) / rate
            j = bisect.bisect(cuts, cuts[i] + step_chars)
            j = j if j != i else i + (1 if n < target else -1)
            j = min(max(j, 1), len(cuts) - 1)
            if j in seen:
                break
            i = j
        return Prompt(text_at(best[0]), kind, best[1])

    @staticmethod
    def _draw(sentences: list[str], sep: str, chars: int, rng: random.Random) -> str:
        out, size, order = [], 0, []
        while size < chars:
            if not order:
                order = rng.sample(sentences, len(sentences))
            s = order.pop()
            out.append(s)
            size += len(s) + len(sep)
        return sep.join(out)
