"""The OpenAI-compatible HTTP app: `create_app(engine, config)` returns a FastAPI app serving one model.

Owns: routes, turning requests into engine prompts and `SamplingParams`, turning `RequestOutput`s into
JSON bodies and SSE streams, the error envelope for every failure, aborting requests whose client went
away, and the engine's start and stop in the app's lifespan.
Does not know how the engine schedules or samples (`AsyncEngine` owns the thread), the wire shapes
(`protocol.py`), the metric names (`metrics.py`) or process concerns like signals and ports (`cli.py`).

Prompts are tokenized (and chat templates rendered, grammars compiled) on a small worker pool, never on
the event loop, and checked against the context before they are queued, so a bad request fails with 400
before any response header is sent, streaming or not, and a huge prompt never stalls other clients.
Every body is a typed pydantic model on its route, so `/openapi.json` documents it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import ferrylm
from ferrylm.engine.async_engine import (AsyncEngine, EngineUnavailableError, QueueFullError, RequestStream,
                                         StepFailedError)
from ferrylm.engine.llm_engine import LLMEngine, RequestOutput
from ferrylm.errors import FerryError, InvalidRequestError
from ferrylm.sampling_params import SamplingParams, StructuredOutput
from ferrylm.server import protocol as P
from ferrylm.server import tool_parser as T
from ferrylm.server.auth import ApiKeyMiddleware, BodyLimitMiddleware, JsonContentTypeMiddleware
from ferrylm.server.metrics import CONTENT_TYPE, Metrics
from ferrylm.server.read_timeout import BodyTimeoutMiddleware
from ferrylm.tokenizer import TooManyTokensError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """What `ferry serve` adds on top of `EngineConfig`."""

    served_model_names: tuple[str, ...]
    """Names clients may ask for; the first is the one /v1/models lists first and responses carry."""
    model_root: str = ""
    """The model path, shown as `root` in /v1/models."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """Required as `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize; None: no auth."""
    max_queued_requests: int | None = 1024
    """Waiting requests beyond which new ones get 503; None: unbounded."""
    max_request_bytes: int = 16 * 2**20
    """Request bodies over this get 413."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight requests before aborting them (their streams end with an error
    event and [DONE], non-streaming ones get 503)."""
    access_log: bool = True
    read_timeout: float = 30.0
    """Seconds a client may take to send a request's headers, and may pause while sending its body (408)."""
    tool_call_parser: str | None = None
    """How tool calls are read out of text when tool_choice is auto (hermes, llama3_json, mistral); None: not read."""
    metrics_compat: str | None = None
    """`vllm`: /metrics also exposes every series under vLLM's `vllm:` names."""
    tokenizer_workers: int = 4
    """Threads that tokenize, render chat templates and compile grammars off the event loop."""


class ApiError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return _JSON(P.error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def api_error(e: Exception) -> ApiError:
    """Map what the engine and server raise onto an HTTP status and envelope."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, QueueFullError):
        return ApiError(503, str(e), "server_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailableError):
        return ApiError(503, str(e), "server_error", code="unavailable")
    if isinstance(e, StepFailedError):
        return ApiError(500, str(e), "server_error", code="step_failed")
    if isinstance(e, RecursionError):
        return ApiError(400, "the request is nested too deeply")
    log.error("unexpected error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def _dumps(obj) -> str:
    # allow_nan=False: a non-finite number (which the sampler never hands out) becomes an error, not bad JSON;
    # ensure_ascii: a lone surrogate echoed from a request (an error message) stays valid, encodable JSON
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


class _JSON(JSONResponse):
    """JSONResponse with `_dumps`: ASCII-safe and never NaN."""

    def render(self, content) -> bytes:
        return _dumps(content).encode()


def check_text(text: str, param: str) -> str:
    """400 for text that is no valid Unicode (a lone surrogate from a JSON `\\ud800` escape): the tokenizer
    cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode: {e.reason} at position {e.start}",
                                  param=param) from None
    return text


def continue_final_message(text: str, last: dict, add_generation_prompt: bool) -> str:
    """The rendered chat cut right after the last message's (stripped) content, as transformers and vLLM
    do for `continue_final_message`: the model continues that message instead of starting a new turn."""
    if add_generation_prompt:
        raise InvalidRequestError("continue_final_message needs add_generation_prompt: false",
                                  param="continue_final_message")
    final = str(last.get("content") or "").strip()
    if not final:
        raise InvalidRequestError("continue_final_message needs the last message to have text content",
                                  param="continue_final_message")
    at = text.rfind(final)
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not write the last message's "
                                  "content verbatim", param="continue_final_message")
    return text[:at + len(final)]


def _sse(obj) -> str:
    return f"data: {_dumps(obj)}\n\n"


def echo_only_output(out: RequestOutput) -> RequestOutput:
    """`echo` with `max_tokens: 0`: the engine's one sampled token dropped from every completion (text, ids,
    logprobs); a finished one ends with "length", as vLLM's does."""
    return dataclasses.replace(out, outputs=[dataclasses.replace(
        c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None, cumulative_logprob=0.0,
        finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason, stop_reason=None)
        for c in out.outputs])


class _Outputs:
    """(prompt index, RequestOutput) from one or several request streams, as they advance."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self._tasks: list[asyncio.Task] = []
        if len(streams) > 1:
            self._queue: asyncio.Queue = asyncio.Queue()
            self._left = len(streams)
            self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((i, None, e))
        self._queue.put_nowait((i, None, StopAsyncIteration()))

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._tasks:
            return 0, await self.streams[0].__anext__()
        while self._left:
            i, out, err = await self._queue.get()
            if isinstance(err, StopAsyncIteration):
                self._left -= 1
            elif err is not None:
                raise err
            else:
                return i, out
        raise StopAsyncIteration

    def close(self) -> None:
        """Abort what has not finished."""
        for t in self._tasks:
            t.cancel()
        for s in self.streams:
            s.close()


@dataclass
class _ChoiceState:
    chars: int = 0
    """Characters of text already sent."""
    tokens: int = 0
    """Tokens already sent (their logprobs too)."""
    offset: int = 0
    """text_offset of the next token (completions logprobs)."""
    done: bool = False
    sent: bool = False
    """A chunk of this choice went out (the first carries the role)."""


@dataclass
class _Tools:
    """How a chat request's tool calls are produced and read back."""

    mode: str = "none"
    """none | auto (a parser reads them from free text) | named (the output is the forced function's arguments)
    | required (the output is {"name", "arguments"})."""
    parser: T.ToolParser | None = None
    name: str | None = None
    """The forced function (named)."""
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def result(self, text: str, finish_reason: str | None) -> tuple[str | None, list[T.ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished choice."""
        if self.mode == "named":
            return None, [T.ToolCall(self.name, text, self.call_id)], finish_reason
        if self.mode == "required":
            calls = T.parse_required(text)
            return (None if calls else text), calls, ("tool_calls" if calls and finish_reason == "stop"
                                                      else finish_reason)
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.parse(text)
            if calls:
                return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
        return text, [], finish_reason


@dataclass
class _Prepared:
    core: LLMEngine
    params: SamplingParams
    prompts: list[list[int]]
    texts: list[str | None] = field(default_factory=list)
    """Echoed prompt text per prompt (completions with echo)."""
    tools: _Tools = field(default_factory=_Tools)


class Serving:
    """The handlers' shared state and logic; routes in `create_app` are thin wrappers around it."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: Metrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.model_name = config.served_model_names[0]
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max(1, min(config.tokenizer_workers, os.cpu_count() or 1)),
                                       thread_name_prefix="ferry-tokenize")
        self.tool_parser = T.get_parser(config.tool_call_parser)

    async def offload(self, fn, *args):
        """Run `fn(*args)` on the worker pool: tokenizing a long prompt must not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- checks ---------------------------------------------------------------------------------------

    def core(self) -> LLMEngine:
        """The loaded engine (for its tokenizer and limits); 503 unless it takes requests now."""
        self.engine.check_accepting()
        return self.engine.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.served_model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def token_text(self, core: LLMEngine) -> Callable[[int], str]:
        tok = core.tokenizer
        if tok is None:
            return lambda t: f"token_id:{t}"
        return lambda t: tok.decode([t], skip_special_tokens=False)

    @staticmethod
    def encode(core: LLMEngine, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; over the context: the context error, raised before a huge id list is built."""
        try:
            return core.tokenizer_required().encode(text, add_special_tokens=add_special_tokens, limit=core.max_seq_len)
        except TooManyTokensError as e:
            raise core.context_error(e.count) from None

    def check_structured(self, core: LLMEngine, params: SamplingParams) -> None:
        """Compile the grammar now (400 before any header), so the engine thread never meets a bad one."""
        if params.structured is not None:
            if core.grammar is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer", param="response_format")
            core.grammar.compile(params.structured)

    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> _Outputs:
        """Queue one engine request per prompt; all or none (the capacity is checked for all of them first)."""
        self.engine.check_capacity(len(prompts))
        streams = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request(ids, params, rid))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return _Outputs(streams)

    # -- /v1/completions ------------------------------------------------------------------------------

    def prepare_completion(self, body: P.CompletionRequest) -> _Prepared:
        """On the worker pool: sampling params, tokenized prompts, checks."""
        core = self.core()
        params = body.sampling_params()
        if body.echo and body.logprobs is not None:  # the echoed prompt carries its logprobs too
            params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        texts, prompts = [], []
        for p in body.prompts():
            if isinstance(p, str):
                ids = self.encode(core, check_text(p, "prompt"))
                texts.append(p)
            else:
                ids = [int(t) for t in p]
                texts.append(None)
            core.check_prompt(ids, params)
            prompts.append(ids)
        if body.echo:  # token-id prompts echo their decoded text
            texts = [t if t is not None else core.tokenizer_required().decode(ids, skip_special_tokens=False)
                     for t, ids in zip(texts, prompts)]
        self.check_structured(core, params)
        return _Prepared(core, params, prompts, texts)

    async def completion(self, body: P.CompletionRequest) -> dict:
        self.check_model(body.model)
        prep = await self.offload(self.prepare_completion, body)
        core, params, prompts, texts = prep.core, prep.params, prep.prompts, prep.texts
        rid = f"cmpl-{uuid.uuid4().hex}"
        outputs = self.submit(prompts, params, rid)
        final: dict[int, RequestOutput] = {}
        try:
            async for i, out in outputs:
                final[i] = echo_only_output(out) if body.echo_only else out
        finally:
            outputs.close()
        choices, n_out, n = [], 0, body.num_choices
        for i in range(len(prompts)):
            prefix = texts[i] if body.echo else ""
            outs = final[i].outputs
            n_out += sum(len(c.token_ids) for c in outs)
            if len(outs) > n:  # best_of: the n with the highest cumulative logprob
                outs = sorted(outs, key=lambda c: -c.cumulative_logprob)[:n]
            for j, c in enumerate(outs):
                lp = None
                if body.logprobs is not None and c.logprobs is not None:
                    lp = P.completion_logprobs(c.token_ids, c.logprobs, self.token_text(core), body.logprobs,
                                               len(prefix))
                    if body.echo and final[i].prompt_logprobs is not None:
                        lp = P.join_completion_logprobs(self._prompt_logprobs(core, final[i], body.logprobs), lp)
                choice = P.completion_choice(i * n + j, prefix + c.text, c.finish_reason, c.stop_reason, lp)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(core, final[i], body.prompt_logprobs)
                choices.append(choice)
        return P.completion(rid, self.model_name, choices, P.usage(sum(map(len, prompts)), n_out))

    async def completion_stream(self, body: P.CompletionRequest) -> tuple[AsyncIterator[str], _Outputs]:
        self.check_model(body.model)
        prep = await self.offload(self.prepare_completion, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        outputs = self.submit(prep.prompts, prep.params, rid)
        return self._stream(outputs, prep, rid, chat=False, echo=prep.texts if body.echo else None,
                            include_usage=body.include_usage, echo_only=body.echo_only), outputs

    def _prompt_logprobs(self, core: LLMEngine, out: RequestOutput, num: int) -> dict:
        return P.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.token_text(core), num, 0)

    def _vllm_prompt_logprobs(self, core: LLMEngine, out: RequestOutput, num: int) -> list[dict | None]:
        """The `prompt_logprobs` request field's answer (vLLM's format)."""
        return P.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, out.prompt_ranks, self.token_text(core),
                                 num)

    # -- /v1/chat/completions -------------------------------------------------------------------------

    def _chat_tools(self, body: P.ChatCompletionRequest) -> tuple[_Tools, StructuredOutput | None]:
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return _Tools(), None
        if choice == "none":
            return _Tools(), None
        if choice == "required":
            return _Tools("required"), StructuredOutput("json", T.required_schema(body.tools))
        forced = body.forced_tool()
        if forced is not None:
            return _Tools("named", name=forced.function.name), StructuredOutput("json", T.arguments_schema(forced))
        return _Tools("auto", self.tool_parser), None

    def prepare_chat(self, body: P.ChatCompletionRequest) -> _Prepared:
        """On the worker pool: sampling params, the rendered chat template, its tokens, checks."""
        core = self.core()
        params = body.sampling_params()
        tools, forced = self._chat_tools(body)
        if forced is not None:
            if params.structured is not None:
                raise InvalidRequestError("tool_choice required or named cannot be combined with response_format",
                                          param="tool_choice")
            params.structured = forced
        if tools.mode == "auto" and isinstance(tools.parser, T.MistralParser):
            params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        tok = core.tokenizer_required()
        # the names the template call itself uses cannot be overridden (a clash would be a TypeError)
        kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items()
                  if k not in ("self", "messages", "add_generation_prompt", "tools") and k.isidentifier()}
        messages, gen = body.template_messages(), body.add_generation_prompt is not False
        text = tok.apply_chat_template(messages, add_generation_prompt=gen, tools=body.tool_dicts(), **kwargs)
        if body.continue_final_message:
            text = continue_final_message(text, messages[-1], gen)
        try:
            ids = self.encode(core, check_text(text, "messages"), add_special_tokens=False)
            core.check_prompt(ids, params)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e).replace("your prompt has", "your messages resulted in"),
                                      param="messages" if e.param == "prompt" else e.param, code=e.code) from None
        self.check_structured(core, params)
        return _Prepared(core, params, [ids], [body.echo_prefix(messages)], tools=tools)

    async def chat(self, body: P.ChatCompletionRequest) -> dict:
        self.check_model(body.model)
        prep = await self.offload(self.prepare_chat, body)
        core, params = prep.core, prep.params
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self.submit(prep.prompts, params, rid)
        final = None
        try:
            async for _, out in outputs:
                final = out
        finally:
            outputs.close()
        choices = []
        for c in final.outputs:
            lp = None
            if params.logprobs is not None and c.logprobs is not None:
                lp = P.chat_logprobs(c.token_ids, c.logprobs, self.token_text(core), params.logprobs)
            content, calls, reason = prep.tools.result(c.text, c.finish_reason)
            if body.echo:  # vLLM's: the content becomes a string, the echoed part first
                content = prep.texts[0] + (content or "")
            choices.append(P.chat_choice(c.index, content, reason, c.stop_reason, lp,
                                         [t.to_dict() for t in calls] or None))
        n_out = sum(len(c.token_ids) for c in final.outputs)
        plp = (self._vllm_prompt_logprobs(core, final, body.prompt_logprobs) if body.prompt_logprobs is not None
               else None)
        return P.chat_completion(rid, self.model_name, choices, P.usage(len(prep.prompts[0]), n_out),
                                 prompt_logprobs=plp)

    async def chat_stream(self, body: P.ChatCompletionRequest) -> tuple[AsyncIterator[str], _Outputs]:
        self.check_model(body.model)
        prep = await self.offload(self.prepare_chat, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self.submit(prep.prompts, prep.params, rid)
        return self._stream(outputs, prep, rid, chat=True, echo=prep.texts if body.echo else None,
                            include_usage=body.include_usage), outputs

    # -- streaming ------------------------------------------------------------------------------------

    async def _stream(self, outputs: _Outputs, prep: _Prepared, rid: str, *, chat: bool,
                      echo: list[str] | None, include_usage: bool, echo_only: bool = False) -> AsyncIterator[str]:
        """SSE events: one chunk per choice that advanced, the last with its finish_reason; then usage, [DONE].

        With stop strings, the last (longest stop - 1) characters are held back until the next token shows
        whether they start a stop string, so text once sent is never taken back. Tool calls: a forced
        function's arguments stream as `tool_calls[0].function.arguments` deltas; otherwise text that may
        start a call is held back and the parsed calls go out whole in the finishing chunk.
        """
        core, params, tools = prep.core, prep.params, prep.tools
        created, model, n = int(time.time()), self.model_name, params.n
        holdback = max(map(len, params.stop)) - 1 if params.stop else 0
        token_text = self.token_text(core) if params.logprobs is not None else None
        states: dict[int, _ChoiceState] = {}
        num_out = 0
        try:
            async for i, out in outputs:
                if echo_only:
                    out = echo_only_output(out)
                for c in out.outputs:
                    idx = i * n + c.index
                    st = states.get(idx)
                    if st is None:
                        st = states[idx] = _ChoiceState(offset=len(echo[i]) if echo is not None else 0)
                    finished = c.finish_reason is not None
                    ntok = len(c.token_ids)
                    if st.done or (ntok == st.tokens and not finished):
                        continue
                    text = c.text
                    end = len(text) if finished else max(st.chars, len(text) - holdback)
                    lp = None
                    if token_text is not None and c.logprobs is not None:
                        if chat:
                            lp = P.chat_logprobs(c.token_ids[st.tokens:], c.logprobs[st.tokens:], token_text,
                                                 params.logprobs)
                        else:
                            lp = P.completion_logprobs(c.token_ids[st.tokens:], c.logprobs[st.tokens:], token_text,
                                                       params.logprobs, st.offset)
                            st.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else st.offset
                    reason = c.finish_reason if finished else None
                    stop_reason = c.stop_reason if finished else None
                    st.tokens, st.done = ntok, finished
                    if finished:
                        num_out += ntok
                    if chat:
                        delta, calls, reason = self._chat_delta(tools, st, text, end, finished, reason)
                        if not st.sent and echo is not None and echo[i]:
                            delta = echo[i] + (delta or "")
                        if not delta and not calls and not finished and lp is None:
                            continue  # nothing to show yet (a tool call is being written)
                        choice = P.chat_delta_choice(idx, delta, not st.sent, reason, stop_reason, lp, calls)
                        chunk = P.chat_completion(rid, model, [choice], None, created, chunk=True)
                    else:
                        delta = text[st.chars:end]
                        if not st.sent and echo is not None:
                            delta = echo[i] + delta
                            if lp is not None and out.prompt_logprobs is not None:
                                lp = P.join_completion_logprobs(
                                    self._prompt_logprobs(core, out, params.logprobs), lp)
                        st.chars = end
                        chunk = P.completion(rid, model, [P.completion_choice(idx, delta, reason, stop_reason, lp)],
                                             None, created)
                    st.sent = True
                    yield _sse(chunk)
            if include_usage:
                u = P.usage(sum(map(len, prep.prompts)), num_out)
                yield _sse(P.chat_completion(rid, model, [], u, created, chunk=True) if chat
                           else P.completion(rid, model, [], u, created))
        except Exception as e:  # noqa: BLE001 - after the headers went out, an error can only be an event
            err = api_error(e)
            yield _sse(P.error_body(err.message, err.type, err.param, err.code))
        finally:
            outputs.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _chat_delta(tools: _Tools, st: _ChoiceState, text: str, end: int, finished: bool,
                    reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """(content delta, tool_calls delta, finish_reason) for one chat choice; advances `st.chars`."""
        if tools.mode == "none" or (tools.mode == "auto" and tools.parser is None):
            delta, st.chars = text[st.chars:end], end
            return delta, None, reason
        if tools.mode == "named":  # the text is the arguments: stream them as they come
            args, st.chars = text[st.chars:end], end
            call = {"index": 0, "function": {"arguments": args}}
            if not st.sent:
                call.update(id=tools.call_id, type="function")
                call["function"]["name"] = tools.name
            return None, ([call] if args or not st.sent else None), reason
        if not finished:
            if tools.mode == "required":  # the whole output is the call: nothing to show until it is complete
                return None, None, None
            limit = min(end, max(st.chars, tools.parser.call_starts_at(text)))  # text that may open a call waits
            delta, st.chars = text[st.chars:limit], limit
            return delta, None, None
        content, calls, reason = tools.result(text, reason)
        if not calls:
            delta, st.chars = text[st.chars:], len(text)
            return delta, None, reason
        rest = (content or "")[st.chars:] if content and content.startswith(text[:st.chars]) else None
        st.chars = len(text)
        return rest or None, [c.to_dict(k) for k, c in enumerate(calls)], reason

    # -- tokenizer endpoints --------------------------------------------------------------------------

    def tokenize(self, body: P.TokenizeRequest) -> dict:
        self.check_model(body.model)
        core = self.core()
        tok = core.tokenizer_required()
        if body.messages is not None:
            messages = P.ChatCompletionRequest(messages=body.messages).template_messages()
            gen = body.add_generation_prompt is not False
            text = tok.apply_chat_template(messages, add_generation_prompt=gen)
            if body.continue_final_message:
                text = continue_final_message(text, messages[-1], gen)
            ids = tok.encode(check_text(text, "messages"), add_special_tokens=bool(body.add_special_tokens))
        elif body.prompt is not None:
            ids = tok.encode(check_text(body.prompt, "prompt"), add_special_tokens=body.add_special_tokens is not False)
        else:
            raise InvalidRequestError("give a prompt or messages", param="prompt")
        strs = [tok.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": core.max_seq_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: P.DetokenizeRequest) -> dict:
        self.check_model(body.model)
        core = self.core()
        vocab = core.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": core.tokenizer_required().decode(body.tokens, skip_special_tokens=False)}

    def models(self) -> dict:
        core = self.core()
        cards = [P.model_card(name, self.config.model_root or name, core.max_seq_len, self.created)
                 for name in self.config.served_model_names]
        return {"object": "list", "data": cards}


class _SSEResponse(StreamingResponse):
    """An event stream that aborts its requests however it ends, even if the body never started."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _unless_disconnected(request: Request, work):
    """Await `work` unless the client goes away first; then cancel it (which aborts its requests)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def _validation_error(exc: RequestValidationError | ValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)


def create_app(engine: AsyncEngine, config: ServerConfig, metrics: Metrics | None = None,
               on_load_failed: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread (loading in the background) and stops it."""
    metrics = metrics or Metrics(config.served_model_names[0], compat=config.metrics_compat)
    metrics.attach(engine)
    serving = Serving(engine, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()

        async def watch_load():
            try:
                await engine.wait_loaded()
                log.info("model loaded: serving %s", ", ".join(config.served_model_names))
                metrics.on_loaded(engine)
            except BaseException as e:  # noqa: BLE001
                if on_load_failed is not None:
                    on_load_failed(e)

        watcher = asyncio.ensure_future(watch_load())
        try:
            yield
        finally:
            watcher.cancel()
            await engine.drain(1.0)  # uvicorn already waited for connections up to the shutdown timeout
            engine.shutdown()
            serving.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ferrylm", version=ferrylm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API (completions, chat completions with tools and structured "
                              "outputs) plus vLLM's tokenizer endpoints. Errors use OpenAI's error envelope.")
    app.state.serving = serving
    errors = {"description": "OpenAI error envelope", "model": P.ErrorResponse}
    error_responses = {s: errors for s in (400, 401, 404, 408, 413, 503)}

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(FerryError)
    async def _ferry_error(request: Request, e: FerryError):
        return api_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = ApiError(e.status_code, str(e.detail), code=code, headers=getattr(e, "headers", None))
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return api_error(e).response()

    def sse(stream: tuple[AsyncIterator[str], _Outputs]) -> StreamingResponse:
        events, outputs = stream
        return _SSEResponse(events, outputs.close)

    @app.get("/health")
    async def health():
        from ferrylm.server import log_errors

        if engine.is_ready:
            if log_errors.lost:  # still serving, but its log is failing: say so where it can be read
                return {"status": "ok", "log_write_errors": log_errors.lost,
                        "warning": f"{log_errors.lost} log records could not be written (the log stream fails)"}
            return {"status": "ok"}
        body = {"status": engine.state.name.lower()}
        if engine.error is not None:
            body["error"] = str(engine.error)
        return _JSON(body, 503)

    @app.get("/version")
    async def version():
        return {"version": ferrylm.__version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=error_responses)
    async def list_models():
        return serving.models()

    @app.get("/v1/models/{model_id:path}", responses=error_responses)
    async def get_model(model_id: str, request: Request):
        # the path as sent: Starlette's `$` also matches before a trailing newline, which would cut it off
        model_id = request.scope["path"][len("/v1/models/"):]
        card = next((c for c in serving.models()["data"] if c["id"] == model_id), None)
        if card is None:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return card

    @app.post("/v1/completions", responses=error_responses)
    async def create_completion(body: P.CompletionRequest, request: Request):
        if body.stream:
            return sse(await serving.completion_stream(body))
        result = await _unless_disconnected(request, serving.completion(body))
        return _JSON(result) if result is not None else Response(status_code=499)

    @app.post("/v1/chat/completions", responses=error_responses)
    async def create_chat_completion(body: P.ChatCompletionRequest, request: Request):
        if body.stream:
            return sse(await serving.chat_stream(body))
        result = await _unless_disconnected(request, serving.chat(body))
        return _JSON(result) if result is not None else Response(status_code=499)

    def encoded(fn):
        """On the worker pool: `fn`'s dict as JSON bytes (a long token list must not be encoded on the loop)."""
        return lambda body: Response(_dumps(fn(body)).encode(), media_type="application/json")

    @app.post("/tokenize", responses=error_responses)
    async def tokenize(body: P.TokenizeRequest):
        return await serving.offload(encoded(serving.tokenize), body)

    @app.post("/detokenize", responses=error_responses)
    async def detokenize(body: P.DetokenizeRequest):
        return await serving.offload(encoded(serving.detokenize), body)

    # outermost last: the body limit and read timeout see the raw body before anything parses it
    app.add_middleware(JsonContentTypeMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout=config.read_timeout)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app
