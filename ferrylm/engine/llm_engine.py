"""LLMEngine: the step loop. schedule -> run the model -> sample -> append, detokenize, check stops.

It owns requests (prompt validation, the `n` sequences of each, stop logic, outputs) and wires the
scheduler, model runner, sampler and tokenizer together. It knows nothing about HTTP or threads: the
offline `LLM` and the async server wrapper drive `step()`.

A step is launched (schedule, inputs, forward, sample: all queued on the device) and later resolved (the
sampled ids reach the host: append, detokenize, stop checks, outputs). Synchronously, each step is
resolved right after its launch. With async scheduling (`EngineConfig.async_scheduling`, vLLM v1's
async scheduling and SGLang's overlap scheduler in spirit) `step()` launches step N+1 first and then
resolves step N, so the host's work for both happens while the device runs step N+1:
  - step N's sampled tokens are counted (`Sequence.num_pending`) but not known when step N+1 is
    scheduled; a decode of such a sequence reads its input id from step N's sampled-id tensor on the
    device (`PrevTokens`), never through the host;
  - stops that depend on the token (EOS, stop ids and strings, a grammar's end) are found one step late:
    a sequence that stopped at step N has run in step N+1 too, and that extra token is dropped, never
    emitted; a sequence whose pending token is its last anyway (max_tokens, the length limit) is not
    scheduled again (`Sequence.final_pending`);
  - requests whose next step needs the last token on the host first fall back to synchronous steps
    while they are in the engine: structured outputs (the grammar's mask) and repetition / presence /
    frequency penalties (they count the tokens). Unseeded random sampling shares one generator across
    rows, so it depends on the batch's membership (one extra row per late stop) and is not reproducible
    across the two modes; seeded and greedy rows are identical.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from ferrylm.config import EngineConfig, ModelConfig
from ferrylm.parallel.launch import start_runner
from ferrylm.engine.model_runner import PrevTokens
from ferrylm.engine.scheduler import Scheduler, SchedulerOutput
from ferrylm.engine.sequence import Sequence, SequenceStatus
from ferrylm.engine.staging import Download, download
from ferrylm.errors import ConfigError, InvalidRequestError, ModelLoadError
from ferrylm.hw.cpu_binding import bind_cpu
from ferrylm.kv.block_manager import BlockManager
from ferrylm.kv.state_pool import StateSlotPool
from ferrylm.layers.sampler import MIN_LOGPROB, Sampler, SampledTokens, uses_penalties
from ferrylm.sampling_params import SamplingParams
from ferrylm.weights.source import open_source

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """stop | length | abort, None while running."""
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    """arrival_time, first_scheduled_time, first_token_time, finished_time (time.monotonic)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token {token: logprob, top-n...}; None for the first."""
    prompt_ranks: list[int | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token its rank among the raw logits (1 = the most
    likely; 1 + the number of tokens with a higher logit); None for the first."""


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    """Filled as the first sequence's prompt is computed (the first token has none)."""
    prompt_ranks: list[int | None] = field(default_factory=lambda: [None])
    """Parallel to `prompt_logprobs`: each prompt token's rank among the raw logits."""

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(genexpr): read for every request every step
            if s.status < SequenceStatus.FINISHED_STOPPED:
                return False
        return True


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    """The rows that sampled, in row order."""
    sampled: SampledTokens
    """Their tokens (and logprobs) on the device."""
    host: Download
    """The copies of `sampled` to pinned host memory, in flight."""
    prev: PrevTokens
    """The ids as the next step's input."""


def needs_sync(params: SamplingParams) -> bool:
    """A request whose next step needs its last token on the host first (async scheduling falls back)."""
    return params.structured is not None or uses_penalties(params)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress=None):
        self.config = config
        bind_cpu(config.threads, config.numa_node)
        source = open_source(config.model)
        if config.dequantize:  # the plain path: the source hands every tensor out dense
            source.get_quantized = lambda name: None
        try:
            self.model_config = ModelConfig.from_hf(source.config)
            self.tokenizer = self._load_tokenizer(source)
            self.max_model_len = self._max_model_len()
            # a ModelRunner, or rank 0's ParallelExecutor driving one worker process per other rank
            self.runner = start_runner(config, self.model_config, source, self.max_model_len, progress=progress)
        finally:
            source.close()
        kv = self.runner.kv_cache
        has_state = self.runner.state_pool is not None
        # models with per-sequence state cannot resume from cached blocks, so they never look them up
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size,
                                          config.cache.enable_prefix_caching and not has_state)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager,
            StateSlotPool(self.runner.state_pool.num_slots) if has_state else None,
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self.sampler = Sampler(eos_token_ids=tuple(sorted(eos)), seed=config.seed)
        self.grammar = None
        """Structured outputs (llguidance); needs the tokenizer."""
        if self.tokenizer is not None:
            from ferrylm.engine.grammar import GrammarEngine

            self.grammar = GrammarEngine(self.tokenizer.backend, self.model_config.vocab_size, sorted(eos))
        self._matchers: dict[int, object] = {}
        """seq_id -> llguidance matcher, for sequences with a structured output."""
        # a sequence ends at the context length or when it alone would fill the KV pool
        self.max_seq_len = min(self.max_model_len, self.scheduler.max_seq_len)
        self.requests: dict[str, _Request] = {}
        self._next_id = 0
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.last_step_tokens = 0
        """Tokens the last step computed (prefill chunks and decodes)."""
        self.async_scheduling = self._async_scheduling()
        """Launch step N+1 before reading step N's tokens (module docstring)."""
        self._inflight: _InFlight | None = None
        self._num_sync_requests = 0
        """Requests in the engine that `needs_sync`: while any is, steps run synchronously."""
        self._num_prompt_logprobs = 0
        """Requests in the engine that want prompt logprobs (no step looks for their rows otherwise)."""
        self.timings: dict[str, float] | None = None
        """Set to {} to accumulate host seconds per phase of `step()` (benchmarks/bench_step_overhead.py)."""

    # -- set-up -----------------------------------------------------------------------------------

    def _load_tokenizer(self, source):
        from ferrylm.tokenizer import Tokenizer

        path = self.config.tokenizer or source.path
        try:
            return Tokenizer.load(path)
        except ModelLoadError as e:
            if self.config.tokenizer:
                raise
            # the message, not the exception: a handler that keeps records (pytest's) would keep its traceback's
            # frames, and this engine with them
            log.warning("no tokenizer (%s): prompts must be given as token ids", str(e))
            return None

    def _async_scheduling(self) -> bool:
        mode = self.config.async_scheduling
        single = self.config.parallel.world_size == 1
        if mode == "on" and not single:  # workers build their inputs from shipped host lists
            log.warning("async scheduling is not supported with tensor / pipeline parallelism: steps run synchronously")
        if mode == "auto":  # on the CPU the host is the device: there is nothing to overlap. Offloaded models
            # gain at batch 1, where the device idled while the host read a step's results (H100, 8-layer Mixtral
            # NF4 and bf16, copy-only and hybrid: medians +3% to +19%), and about break even at batch 16 (-3% to
            # +4.5%; session 40's `benchmarks/ab_async_offload.py`, docs/benchmarks.md)
            return single and self.runner.device.type == "cuda"
        return mode == "on" and single

    def _max_model_len(self) -> int:
        limit = self.config.scheduler.max_model_len
        native = self.model_config.context_limit  # max_position_embeddings, stretched by rope scaling
        if limit is not None and limit > native:
            raise ConfigError(f"max_model_len {limit} exceeds the model's {native} positions")
        return limit or native

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: give the prompt as token ids", param="prompt")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_prompt(ids, params)
        matchers = []
        if params.structured is not None:
            if self.grammar is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer", param="response_format")
            matchers = [self.grammar.matcher(params.structured) for _ in range(params.n)]
        # n > 1 with a seed: each child gets seed + index, so the completions differ but stay reproducible
        seqs = [Sequence(list(ids), params if params.seed is None or i == 0 else
                         dataclasses.replace(params, seed=params.seed + i), request_id=request_id)
                for i in range(params.n)]
        req = _Request(request_id, text, ids, params, seqs)
        if self.tokenizer is not None:
            # the prompt is context: SentencePiece decoders drop a leading space on a lone first token
            req.detoks = [self.tokenizer.incremental_detokenizer(params.skip_special_tokens, prompt_ids=ids)
                          for _ in seqs]
        req.texts = ["" for _ in seqs]
        for s, m in zip(seqs, matchers):
            self._matchers[s.seq_id] = m
        for s in seqs:
            self.scheduler.add(s)
        self.requests[request_id] = req
        self._num_sync_requests += needs_sync(params)
        self._num_prompt_logprobs += params.prompt_logprobs is not None
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        bias = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bias:
            raise InvalidRequestError(f"logit_bias token id {bias[0]} is outside the vocabulary [0, {vocab})",
                                      param="logit_bias")
        if len(ids) >= self.max_seq_len:
            raise self.context_error(len(ids))

    def context_error(self, num_tokens: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"This model's maximum context length is {self.max_seq_len} tokens. However, your prompt has "
            f"{num_tokens} tokens, leaving no room to generate. Please reduce the length of the prompt.",
            param="prompt", code="context_length_exceeded")

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._forget(req)
        self.scheduler.abort(request_id)  # a step in flight drops its tokens when it is resolved

    def tokenizer_required(self):
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: give prompts as token ids", param="messages")
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def rows_in_flight(self) -> int:
        """Sampled rows of a launched step the host has not read yet (async scheduling): their tokens come with the
        next `step()`, though the device may have computed them already."""
        return len(self._inflight.seqs) if self._inflight is not None else 0

    def check_health(self) -> None:
        """Raises when the engine can no longer run steps (a parallel engine that lost a worker)."""
        if hasattr(self.runner, "check_health"):
            self.runner.check_health()

    def close(self) -> None:
        """Release the engine now (idempotent; no step runs afterwards): worker processes of a parallel engine
        stop, and the runner gives back its device memory, host registrations and threads
        (`ModelRunner.close`); a step still in flight is dropped."""
        self._inflight = None
        if hasattr(self.runner, "close"):
            self.runner.close()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that advanced (finished ones last time),
        or with `final_only` for those that finished (the offline API builds no others).
        With async scheduling the outputs are those of the step launched by the previous call."""
        t0 = time.perf_counter()
        overlap = self.async_scheduling and not self._num_sync_requests
        if self._inflight is not None and not overlap:  # drain first: the next step needs the tokens
            inflight, self._inflight = self._inflight, None
            return self._resolve(inflight, t0, final_only)
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_batched_tokens
        t0 = self._tick("schedule", t0)
        launched = self._launch(out, t0) if not out.is_empty else None
        t0 = time.perf_counter()
        inflight, self._inflight = self._inflight, None
        outputs = self._resolve(inflight, t0, final_only) if inflight is not None else []
        if launched is not None:
            if overlap:
                self._inflight = launched
            else:
                outputs = self._resolve(launched, t0, final_only)
        if self._inflight is not None and not self.requests:
            # every row of the launched step stopped one step late: nothing would resolve it, and it must not
            # outlive what it reads (an offloaded model's registered host memory, a hybrid step's host worker)
            inflight, self._inflight = self._inflight, None
            try:
                self._resolve(inflight, time.perf_counter(), final_only)  # drops its rows: no outputs
            except Exception:
                if not outputs:
                    raise
                # its tokens are dropped anyway: the outputs of the requests that just finished must not be lost
                log.exception("a step launched after the last requests stopped failed (its tokens were dropped)")
        return outputs

    def wait_idle(self) -> None:
        """Before a timed window: wait for the device, with a launched step's bookkeeping done (an offloaded
        model's routing counts read and the copies they queue landed), so the window holds only the steps after
        it. A step in flight stays unresolved: its `rows_in_flight` tokens come with the next `step()`."""
        device = self.runner.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if hasattr(self.runner, "check_step"):
            self.runner.check_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def _tick(self, phase: str, t0: float) -> float:
        t = time.perf_counter()
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + t - t0
        return t

    def _launch(self, out: SchedulerOutput, t0: float) -> _InFlight | None:
        """Queue the step on the device: inputs, forward, sampling, the copy of the ids to the host."""
        # out.samples(i), before postprocess moves the counts
        sampling = [s for s, n in zip(out.seqs, out.num_new_tokens)
                    if s.num_computed_tokens + n == len(s.token_ids) + s.num_pending]
        extra, where = self._prompt_logit_rows(out) if self._num_prompt_logprobs else ((), ())
        prev = self._inflight.prev if self._inflight is not None else None
        logits = self.runner.execute(out, extra, prev) if prev is not None else self.runner.execute(out, extra)
        if self.timings is not None:
            prep = getattr(self.runner, "prepare_s", 0.0)
            self.timings["prepare"] = self.timings.get("prepare", 0.0) + prep
            t0 += prep
        t0 = self._tick("forward", t0)
        if extra:
            logits, prompt_logits = logits[:len(sampling)], logits[len(sampling):]
            self._record_prompt_logprobs(prompt_logits, where)
        self.scheduler.postprocess(out)
        if not sampling:
            return None
        # the sampler reads a Sequence as a row; its count includes pending tokens, as a synchronous step's would
        sampled = self.sampler(logits, sampling, self._allowed(sampling), True)
        limit = self.max_seq_len
        for s in sampling:
            s.num_pending += 1
            mt, n = s.sampling_params.max_tokens, len(s.token_ids) + s.num_pending  # s.num_tokens
            if n >= limit or mt is not None and n - len(s.prompt_token_ids) >= mt:
                s.final_pending = True  # it finishes on this token: no step for a token nobody will see
        inflight = _InFlight(sampling, sampled, download(sampled.tensors()),
                             PrevTokens(sampled.token_ids, {s.seq_id: i for i, s in enumerate(sampling)}))
        self._tick("sample", t0)
        return inflight

    def _resolve(self, step: _InFlight, t0: float, final_only: bool = False) -> list[RequestOutput]:
        """The step's tokens reach the host: append them, check stops, build the outputs."""
        result = step.sampled.output(step.host.wait())
        if hasattr(self.runner, "check_step"):  # a host expert worker's failure: this step's tokens are wrong
            self.runner.check_step()
        t0 = self._tick("wait", t0)
        now, bs = time.monotonic(), self.block_manager.block_size
        touched: dict[str, _Request] = {}
        for row, (seq, tok) in enumerate(zip(step.seqs, result.token_ids)):
            if seq.is_finished:  # stopped (one step late) or aborted while this step ran: drop its token
                continue
            req = self.requests[seq.request_id]
            seq.resolve_pending(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if result.logprobs is not None and result.logprobs[row] is not None:
                seq.logprobs.append(result.logprobs[row])
                seq.cumulative_logprob += result.logprobs[row][tok]
            self.stats["generation_tokens"] += 1
            self._check_stop(req, seq, tok, self._advance_grammar(seq, tok))
            known = len(seq.token_ids)
            if known % bs == 0 and seq.num_computed_tokens >= known and not seq.is_finished:
                # the token completes a block the next step already computed: findable by its hash now
                self.block_manager.cache_full_blocks(seq)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                outputs.append(self._output(req, now, True))
                del self.requests[req.request_id]
                self._forget(req)
            elif not final_only:
                outputs.append(self._output(req, now, False))
        self._tick("postprocess", t0)
        return outputs

    def _forget(self, req: _Request) -> None:
        """A request left the engine (finished or aborted)."""
        for s in req.seqs:
            self._matchers.pop(s.seq_id, None)
        self._num_sync_requests -= needs_sync(req.params)
        self._num_prompt_logprobs -= req.params.prompt_logprobs is not None

    def _prompt_logit_rows(self, out) -> tuple[list[int], list[tuple[_Request, int]]]:
        """Rows of this step's token batch whose logits give prompt logprobs, and (request, prompt index) each
        predicts. Only the first of a request's sequences is read; positions already recorded (before a
        preemption) are skipped."""
        rows, where, offset = [], [], 0
        for seq, n in zip(out.seqs, out.num_new_tokens):
            req = self.requests.get(seq.request_id)
            if seq.sampling_params.prompt_logprobs is not None and req is not None and req.seqs[0] is seq:
                start = seq.num_computed_tokens
                # the logits at position q predict token q + 1; the last prompt position's predict the output
                for q in range(max(start, len(req.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append(offset + q - start)
                    where.append((req, q + 1))
            offset += n
        return rows, where

    def _record_prompt_logprobs(self, logits: torch.Tensor, where: list[tuple[_Request, int]]) -> None:
        # logits: [P, V]
        lp = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
        lp = torch.nan_to_num_(lp, nan=MIN_LOGPROB, neginf=MIN_LOGPROB).clamp_(MIN_LOGPROB, 0.0)
        ids = torch.tensor([req.prompt_token_ids[i] for req, i in where], device=lp.device)
        chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()  # [P]
        # rank: 1 + how many raw logits beat the prompt token's (a [P, V] compare, as cheap as the softmax)
        raw = logits.float()  # [P, V]
        ranks = ((raw > raw.gather(1, ids[:, None])).sum(1) + 1).tolist()  # [P]
        n = min(max(req.params.prompt_logprobs for req, _ in where), lp.shape[1])
        top_lp, top_id = (lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long()))  # [P, N]
        top_lp, top_id = top_lp.tolist(), top_id.tolist()
        for j, (req, i) in enumerate(where):
            d = {req.prompt_token_ids[i]: chosen[j]}
            for k in range(min(req.params.prompt_logprobs, n)):
                d.setdefault(top_id[j][k], top_lp[j][k])
            req.prompt_logprobs.append(d)
            req.prompt_ranks.append(ranks[j])

    def _allowed(self, seqs: list[Sequence]):
        """(rows, bitmask) of the rows a grammar constrains this step, or None."""
        if not self._matchers:
            return None
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self._matchers]
        if not rows:
            return None
        mask = self.grammar.fill_bitmask([self._matchers[seqs[i].seq_id] for i in rows])  # [M, W]
        return torch.tensor(rows), mask

    def _advance_grammar(self, seq: Sequence, tok: int) -> bool:
        """Feed the token to the sequence's matcher; True when the grammar is complete (or broken)."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            return False
        if not m.consume_token(tok):
            log.warning("sequence %s left its grammar: %s", seq.seq_id, m.get_error())
            return True
        return m.is_stopped()

    def _check_stop(self, req: _Request, seq: Sequence, tok: int, grammar_done: bool = False) -> None:
        p, i = req.params, 0 if len(req.seqs) == 1 else req.seqs.index(seq)
        n_out = len(seq.token_ids) - len(seq.prompt_token_ids)  # a later step's pending token is not counted
        status = None
        hidden_tok = False  # EOS and stop ids are not shown as text unless asked
        if tok in self.eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
            status, hidden_tok = SequenceStatus.FINISHED_STOPPED, True
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            status, seq.stop_reason, hidden_tok = SequenceStatus.FINISHED_STOPPED, tok, not p.include_stop_str_in_output
        if req.detoks and not hidden_tok:
            delta = req.detoks[i].add(tok)
            if delta:
                prev = req.texts[i]
                req.texts[i] = prev + delta
                if p.stop and n_out >= p.min_tokens:
                    self._check_stop_strings(req, seq, i, len(prev))
                    if seq.stop_reason is not None and status is None:
                        status = SequenceStatus.FINISHED_STOPPED
        if status is None and grammar_done:
            status = SequenceStatus.FINISHED_STOPPED
        if status is None and (p.max_tokens is not None and n_out >= p.max_tokens):
            status = SequenceStatus.FINISHED_LENGTH
        if status is None and seq.num_known_tokens >= self.max_seq_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if req.detoks and not isinstance(seq.stop_reason, str):
                req.texts[i] += req.detoks[i].flush()  # an incomplete character held back, if any
            self.scheduler.finish(seq, status)

    def _check_stop_strings(self, req: _Request, seq: Sequence, i: int, prev_len: int) -> None:
        text = req.texts[i]
        for stop in req.params.stop:
            # only the new text (plus a stop's length of overlap) can hold a new match
            at = text.find(stop, max(0, prev_len - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if req.params.include_stop_str_in_output else at
                req.texts[i] = text[:end]
                seq.stop_reason = stop
                return

    def _output(self, req: _Request, now: float | None = None, finished: bool | None = None) -> RequestOutput:
        finished = req.finished if finished is None else finished
        lp = req.params.logprobs is not None
        outs = [CompletionOutput(
            index=i, text=req.texts[i], token_ids=s.output_token_ids,  # a fresh slice
            finish_reason=s.status.finish_reason, stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if lp else None,
            cumulative_logprob=s.cumulative_logprob) for i, s in enumerate(req.seqs)]
        first = req.seqs[0]
        first_token = first.first_token_time if len(req.seqs) == 1 else \
            min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        return RequestOutput(
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            prompt_ranks=list(req.prompt_ranks) if req.params.prompt_logprobs is not None else None,
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=outs, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics={"arrival_time": req.arrival_time, "first_scheduled_time": first.first_scheduled_time,
                     "first_token_time": first_token,
                     "finished_time": (now or time.monotonic()) if finished else None})
