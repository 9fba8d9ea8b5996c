"""`Client`: streams one completion or chat request to an OpenAI-compatible server and fills its `Record`.

Asks `stream_options.include_usage` and takes token counts from the last `usage` seen (vLLM and ferrylm send
it in a final chunk; some llama.cpp builds put it on the finishing chunk or send none: then the count is the
number of chunks that carried text, and the record says so). A chunk counts as a token arrival only if it
carries text (chat `delta.content` or `delta.reasoning_content`, completions `text`), so a role-only first
chunk is not a first token. Errors (HTTP status, an error event inside the stream, timeouts, refused or
dropped connections) are recorded, never raised. Does not know schedules, concurrency or statistics.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

from ferrylm.bench.config import BenchConfig
from ferrylm.bench.record import Record
from ferrylm.bench.workload.prompts import Prompt


def auth_headers(cfg: BenchConfig) -> dict:
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_text(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    except (ValueError, AttributeError):
        pass
    return text[:500]


class Client:
    def __init__(self, cfg: BenchConfig, model: str | None, t0: float):
        self.cfg, self.model, self.t0 = cfg, model, t0
        n = max(cfg.max_concurrency, 1)
        self.http = httpx.AsyncClient(
            base_url=cfg.base_url, headers=auth_headers(cfg), timeout=httpx.Timeout(cfg.request_timeout, connect=30.0),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def body(self, p: Prompt) -> tuple[str, dict]:
        cfg = self.cfg
        body = {"max_tokens": p.max_tokens or cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        if cfg.api == "chat":
            body["messages"] = list(p.messages) if p.messages else [{"role": "user", "content": p.text}]
            return "/v1/chat/completions", body
        body["prompt"] = p.text
        return "/v1/completions", body

    async def send(self, p: Prompt, rec: Record) -> Record:
        """Fill `rec` from one streamed request; errors land in the record, a cancel marks it cancelled."""
        path, body = self.body(p)
        rec.sent = self.now()
        rec.prompt_tokens_fitted = p.tokens
        usage: dict = {}
        try:
            # the whole request is bounded, not only each read: a stream that trickles forever still ends
            await asyncio.wait_for(self._stream(path, body, rec, usage), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            rec.error = f"timeout after {self.cfg.request_timeout:g} s"
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        except httpx.HTTPError as e:  # refused, reset, server gone mid-stream
            rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        finally:
            rec.end = self.now()
            if isinstance(usage.get("completion_tokens"), int):
                rec.output_tokens, rec.tokens_from = usage["completion_tokens"], "usage"
                rec.prompt_tokens = usage.get("prompt_tokens")
            else:
                rec.output_tokens, rec.tokens_from = len(rec.chunk_times), "chunks"
            if rec.prompt_tokens is None:
                rec.prompt_tokens = p.tokens
        if rec.status == 200 and rec.first is None and rec.error is None:
            rec.error = "stream ended without any text"
        return rec

    async def _stream(self, path: str, body: dict, rec: Record, usage: dict) -> None:
        async with self.http.stream("POST", path, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {_error_text(await r.aread())}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    rec.error = f"bad stream event: {data[:200]}"
                    return
                if chunk.get("error"):
                    err = chunk["error"]
                    rec.error = "stream error: " + str(err.get("message") if isinstance(err, dict) else err)[:500]
                    return
                if chunk.get("usage"):  # the last one wins (some servers send running totals)
                    usage.clear()
                    usage.update(chunk["usage"])
                for c in chunk.get("choices") or ():
                    delta = c.get("delta") or {}
                    text = c.get("text") or delta.get("content") or delta.get("reasoning_content")
                    if text:
                        t = self.now()
                        rec.first = t if rec.first is None else rec.first
                        rec.chunk_times.append(t)
                    rec.finish_reason = c.get("finish_reason") or rec.finish_reason

    async def aclose(self) -> None:
        await self.http.aclose()
