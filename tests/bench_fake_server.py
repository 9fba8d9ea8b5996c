"""A test-only OpenAI-style streaming server for `ferry bench` tests, for what a real `ferry serve` cannot be
made to do on purpose: grow its memory on every request (a leak to detect), answer some requests with 500,
die in the middle of a run, and speak llama.cpp's dialect (a /tokenize that takes `content`, no `usage` in
streams, a role-only first chat chunk). Everything else the bench does is tested against the real server.

    python tests/bench_fake_server.py --port P [--leak-mb-per-request X] [--fail-every N] [--die-after N]
                                      [--llamacpp] [--itl 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

a = argparse.ArgumentParser()
a.add_argument("--port", type=int, required=True)
a.add_argument("--leak-mb-per-request", type=float, default=0.0)
a.add_argument("--fail-every", type=int, default=0)
a.add_argument("--die-after", type=int, default=0)
a.add_argument("--llamacpp", action="store_true")
a.add_argument("--itl", type=float, default=0.01)
args = a.parse_args()

app = FastAPI()
kept: list[bytes] = []
served = 0


@app.get("/health")
async def health():
    return {"status": "ok"}


@app.get("/v1/models")
async def models():
    return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}


@app.post("/tokenize")
async def tokenize(request: Request):
    body = await request.json()
    if not args.llamacpp:
        return JSONResponse({"error": "not found"}, 404)
    # llama.cpp: a body without `content` is not an error, it just has no tokens
    return {"tokens": list(range(len(body.get("content", "").split())))}


async def _generate(request: Request, chat: bool):
    global served
    served += 1
    n = served
    body = await request.json()
    if args.leak_mb_per_request:
        kept.append(os.urandom(int(args.leak_mb_per_request * 1e6)))  # random bytes: every page is touched
    if args.fail_every and n % args.fail_every == 0:
        return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
    max_tokens = int(body.get("max_tokens", 16))

    def chunk(text=None, finish=None, usage=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text, "finish_reason": finish}]
        return "data: " + json.dumps({"choices": [] if usage else choices, **({"usage": usage} if usage else {})}) + "\n\n"

    async def events():
        if chat and args.llamacpp:
            yield chunk(role=True)
        for i in range(max_tokens):
            await asyncio.sleep(args.itl)
            if args.die_after and n > args.die_after and i == max_tokens // 2:
                os._exit(1)
            yield chunk(f"t{i} ", "length" if i == max_tokens - 1 else None)
        if not args.llamacpp and (body.get("stream_options") or {}).get("include_usage"):
            yield chunk(usage={"prompt_tokens": 7, "completion_tokens": max_tokens, "total_tokens": 7 + max_tokens})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(request: Request):
    return await _generate(request, chat=False)


@app.post("/v1/chat/completions")
async def chat(request: Request):
    return await _generate(request, chat=True)


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
