"""The OpenAI wire format: pydantic request models (unknown fields ignored) and the JSON bodies we answer.

Owns: which request fields exist and how they map onto `SamplingParams`; the shape of completions, chat
completions, stream chunks, logprobs, usage and the error envelope. Responses are plain dicts built by
small functions, because a stream chunk goes out per token and pydantic would cost more than the JSON.
Does not know the engine, HTTP status codes or routing.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ferrylm.errors import InvalidRequestError
from ferrylm.sampling_params import SamplingParams, StructuredOutput


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)


class StreamOptions(_Lenient):
    include_usage: bool | None = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    """{token id (as a string, JSON keys are strings): bias in [-100, 100]}."""
    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    """vLLM's extras: a JSON schema, a regex, one of several strings, or a Lark / GBNF grammar."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None
    """vLLM's extra: logprob, rank and text of each prompt token after the first, with the top N ([0, 20]);
    answered as `prompt_logprobs` (completions: in each choice; chat: beside `choices`, as vLLM does).
    Not streamable (400), as in vLLM."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured(self) -> StructuredOutput | None:
        """The one output constraint asked for (several at once: 400)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                          param="response_format")
            found.append(StructuredOutput("json", rf.json_schema.schema_))
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if value is not None:
                found.append(StructuredOutput(kind, value))
        if len(found) > 1:
            raise InvalidRequestError("give one of response_format, guided_json, guided_regex, guided_choice, "
                                      "guided_grammar", param="response_format")
        return found[0] if found else None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                out[int(k)] = v
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
        return out

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams validate every value and name the bad one (InvalidRequestError -> 400)."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs cannot be streamed (as in vLLM); send stream: false",
                                      param="prompt_logprobs")
        return SamplingParams(
            n=1 if self.n is None else self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens or 0,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos), include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens is not False,
            logit_bias=self._logit_bias(), structured=self.structured(), prompt_logprobs=self.prompt_logprobs,
        )


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    max_tokens: int | None = 16
    """OpenAI's default for completions; null means up to the context length; 0 only with `echo`."""
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    """Generate this many per prompt and return the `n` with the highest cumulative logprob (not streamable)."""

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0` (vLLM's form): the prompt (and with `logprobs` its logprobs), nothing
        generated. The engine samples one token, as vLLM's does, and the server drops it."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be a positive integer (0 only with echo: true), got 0",
                                      param="max_tokens")
        params = self._params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.best_of is not None and self.best_of != params.n:
            if self.best_of < params.n:
                raise InvalidRequestError(f"best_of must be >= n ({params.n}), got {self.best_of}", param="best_of")
            if self.stream:
                raise InvalidRequestError("best_of > n cannot be streamed", param="best_of")
            params.n = self.best_of
            params.validate()
        return params

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if p is None or (isinstance(p, (str, list)) and len(p) == 0):
            raise InvalidRequestError("prompt must be a non-empty string, list of strings or token ids", param="prompt")
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        if any(isinstance(x, list) and not x for x in p):
            raise InvalidRequestError("a token-id prompt is empty", param="prompt")
        return list(p)


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema for the arguments."""


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    """Default: auto when tools are given."""
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    """vLLM's extra: the prompt ends inside the last message (an assistant prefill the model continues), not
    after its end-of-turn; needs `add_generation_prompt: false`."""
    echo: bool | None = False
    """vLLM's extra: the answer's content begins with the last message's content when that message's role is
    the one answering (assistant, or the last role with `add_generation_prompt: false`)."""
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat templates expect them (OpenAI's shape), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced_tool(self) -> Tool | None:
        """The tool a named tool_choice forces, checked against `tools`."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        for t in self.tools or []:
            if t.function.name == name:
                return t
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def echo_prefix(self, messages: list[dict[str, Any]]) -> str:
        """What `echo` puts before the generated content (vLLM's rule): the last message's text if its role is
        the answering one, else ""."""
        if not self.echo:
            return ""
        role = "assistant" if self.add_generation_prompt is not False else messages[-1]["role"]
        return str(messages[-1].get("content") or "") if messages[-1]["role"] == role else ""

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages with list-of-parts content flattened to text (the templates expect strings)."""
        if not self.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        out = []
        for m in self.messages:
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError("each message needs a role", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if isinstance(part, str):
                        texts.append(part)
                    elif isinstance(part, dict) and part.get("type") == "text":
                        texts.append(str(part.get("text", "")))
                    else:
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise InvalidRequestError(f"content parts of type {kind!r} are not supported (text only)",
                                                  param="messages")
                m = {**m, "content": "\n".join(texts)}
            elif content is None:  # an assistant turn that only called tools: templates read content anyway
                m = {**m, "content": ""}
            out.append(m)
        return out


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template writes its own)."""
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    """As in chat completions: the tokens end inside the last message (needs `add_generation_prompt: false`)."""
    return_token_strs: bool | None = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers (OpenAI's envelope)."""

    error: ErrorDetail


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, root: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ferrylm", "root": root,
            "parent": None, "max_model_len": max_model_len}


def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason=None, logprobs=None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion(request_id: str, model: str, choices: list[dict], usage_: dict | None,
               created: int | None = None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_choice(index: int, text: str | None, finish_reason: str | None, stop_reason=None, logprobs=None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_delta_choice(index: int, text: str | None, first: bool, finish_reason: str | None, stop_reason=None,
                      logprobs=None, tool_calls: list[dict] | None = None) -> dict:
    # the role rides on the first token's chunk: no role-only chunk ahead of it (clients time TTFT from it)
    delta = {"role": "assistant"} if first else {}
    if text or not tool_calls:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_completion(request_id: str, model: str, choices: list[dict], usage_: dict | None,
                    created: int | None = None, chunk: bool = False, prompt_logprobs: list | None = None) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


# -- logprobs ------------------------------------------------------------------------------------------

def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], token_text, num: int,
                        text_offset: int) -> dict:
    """OpenAI's legacy completions format: parallel lists, top_logprobs as {token text: logprob}."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tid)
        tokens.append(s)
        lps.append(entry.get(tid) if entry is not None else None)  # None: the first prompt token
        tops.append({token_text(t): lp for t, lp in _top(entry, num)} if num > 0 and entry is not None else None)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def join_completion_logprobs(a: dict, b: dict) -> dict:
    """Two runs of completions logprobs (echoed prompt, then output) as one."""
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], token_text, num: int) -> dict:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for tid, entry in zip(token_ids, entries):
        s = token_text(tid)
        content.append({"token": s, "logprob": entry.get(tid), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (t := token_text(i)), "logprob": lp,
                                          "bytes": list(t.encode("utf-8"))} for i, lp in _top(entry, num)]})
    return {"content": content}


def prompt_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], ranks: list[int | None],
                    token_text, num: int) -> list[dict | None]:
    """vLLM's format: per prompt token None (the first) or {token id as a string: {logprob, rank,
    decoded_token}} holding the prompt token itself and the top `num` (ranked 1..num by logprob)."""
    out = []
    for tid, entry, rank in zip(token_ids, entries, ranks):
        if entry is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": entry[tid], "rank": rank, "decoded_token": token_text(tid)}}
        for k, (t, lp) in enumerate(_top(entry, num)):
            d.setdefault(str(t), {"logprob": lp, "rank": k + 1, "decoded_token": token_text(t)})
        out.append(d)
    return out
