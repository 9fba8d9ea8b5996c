"""AsyncEngine: one background thread owns an `LLMEngine`; asyncio code submits requests and awaits outputs.

Owns: the engine thread (it builds the engine, so loading never blocks the event loop), the hand-off of
commands in (a `SimpleQueue` the idle thread blocks on) and of outputs out (one `call_soon_threadsafe` per
step), the per-request streams, the bounded waiting queue, the life-cycle (loading, ready, draining,
stopped, dead) and a per-step snapshot of the engine's counters for metrics.
Does not know HTTP, JSON or the OpenAI API: the server turns `RequestOutput`s into responses.

The engine is not thread-safe, so nothing but the engine thread calls into it. The event loop only reads
values fixed at load time (tokenizer, model config, `max_seq_len`) and the published `EngineStats`.
Outputs are cumulative (full text and token ids so far), so a stream keeps only the latest one: a consumer
that falls behind skips intermediate outputs instead of queueing them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from ferrylm.engine.llm_engine import LLMEngine, RequestOutput
from ferrylm.errors import FerryError, InvalidRequestError
from ferrylm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(FerryError):
    """More requests are waiting than `max_queued_requests` allows (HTTP 503)."""


class EngineUnavailableError(FerryError):
    """The engine is loading, draining for shutdown, stopped or dead (HTTP 503)."""


class StepFailedError(FerryError):
    """One engine step raised (e.g. out of memory on a large prefill): its requests fail (HTTP 500),
    the server keeps serving. `MAX_STEP_FAILURES` failures in a row mark the engine dead."""


MAX_STEP_FAILURES = 3


class EngineState(enum.IntEnum):
    """Life-cycle; everything >= DRAINING refuses new requests."""

    LOADING = 0
    READY = 1
    DRAINING = 2
    """Shutting down: in-flight requests finish, new ones are refused."""
    STOPPED = 3
    DEAD = 4
    """Loading failed or a step raised; `AsyncEngine.error` says why."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread publishes after every iteration (counters are cumulative)."""

    num_running: int = 0
    """Unfinished requests with no sequence waiting."""
    num_waiting: int = 0
    """Requests with a sequence in the scheduler's waiting queue (new or preempted)."""
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """In tokens."""
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    offload: dict | None = None
    """The offload engine's cumulative counters (`OffloadStats` fields); None when everything is resident."""


class StatListener(Protocol):
    """Receives request events on the event loop thread (the server's Prometheus metrics)."""

    def on_request(self, request_id: str, arrival_time: float, params: SamplingParams) -> None: ...
    def on_step(self, num_tokens: int) -> None: ...
    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...
    def on_abort(self, request_id: str) -> None: ...


_ADD, _ABORT, _STOP = 0, 1, 2


class RequestStream:
    """Async iterator over one request's outputs; the last one has `finished`. `close()` aborts it if unfinished."""

    __slots__ = ("request_id", "_engine", "_event", "_latest", "_error", "_done")

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._done = False

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            self._done = True
            self._engine._forget(self.request_id)
            raise self._error
        out = self._latest
        if out.finished:
            self._done = True
            self._engine._forget(self.request_id)
        return out

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._done:
            self._done = True
            self._engine._abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], LLMEngine], *, max_queued_requests: int | None = None,
                 listener: StatListener | None = None):
        """`engine_factory` builds the engine on the engine thread (e.g. `lambda: LLM(path, ...).engine`).
        `max_queued_requests`: waiting requests beyond which `add_request` raises QueueFullError (None: no bound)."""
        self._factory = engine_factory
        self.max_queued_requests = max_queued_requests
        self.listener = listener
        self.engine: LLMEngine | None = None
        """Set once loaded. Read only its load-time constants (tokenizer, model_config, max_seq_len) here."""
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future | None = None
        self._max_num_seqs = 1

    # -- life-cycle (event loop thread) --------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop. Loading happens on the thread."""
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, name="ferry-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        """Returns once the engine is ready; raises the load error if loading failed."""
        await asyncio.shield(self._loaded)

    @property
    def is_loaded(self) -> bool:
        return self.engine is not None

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones carry on."""
        if self.state < EngineState.DRAINING:
            self.state = EngineState.DRAINING

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` s for in-flight ones; True when none is left."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def abort_all(self, error: BaseException) -> int:
        """Fail every in-flight request with `error` (their streams end with it) and abort them; returns how many."""
        streams = list(self._streams.values())
        for stream in streams:
            stream._fail(error)
            self._abort(stream.request_id)
        return len(streams)

    def abort_all_later(self, delay: float, error: BaseException, then: Callable[[int], None] | None = None) -> None:
        """From any thread, a signal handler too: `abort_all(error)` on the event loop after `delay` seconds,
        then `then(how many)`."""
        def run():
            n = self.abort_all(error)
            if then is not None:
                then(n)

        if self._loop is not None:  # call_soon_threadsafe only writes to the loop's self-pipe
            self._loop.call_soon_threadsafe(self._loop.call_later, delay, run)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort whatever is left and stop the engine thread."""
        if self.state < EngineState.STOPPED:
            self.state = EngineState.STOPPED
        for stream in list(self._streams.values()):
            stream._fail(EngineUnavailableError("the server is shutting down"))
        self._streams.clear()
        self._inbox.put((_STOP,))
        # a thread still inside the model load cannot be interrupted; it is a daemon, so nobody waits for it
        if self._thread is not None and self._thread is not threading.current_thread() and self.is_loaded:
            self._thread.join(timeout)

    # -- requests (event loop thread) ----------------------------------------------------------------

    def check_accepting(self) -> None:
        """Raise EngineUnavailableError unless new requests can be taken now."""
        if self.state == EngineState.READY:
            return
        why = {EngineState.LOADING: "the model is still loading",
               EngineState.DRAINING: "the server is shutting down",
               EngineState.STOPPED: "the server is shutting down",
               EngineState.DEAD: f"the engine died: {self.error}"}[self.state]
        raise EngineUnavailableError(why)

    def check_capacity(self, num_requests: int) -> None:
        """Raise unless `num_requests` more requests fit now: InvalidRequestError (400) when they never can
        (more than the batch's seats plus the waiting queue), QueueFullError (503, retry) when they do not fit yet.
        Checked once for a whole multi-prompt request, so it is queued all or nothing."""
        if self.max_queued_requests is None:
            return
        seats = self._max_num_seqs
        limit = seats + self.max_queued_requests
        if num_requests > limit:
            raise InvalidRequestError(
                f"this request holds {num_requests} prompts but the server takes at most {limit} requests at once "
                f"({seats} running + {self.max_queued_requests} waiting); send fewer prompts per request",
                param="prompt", code="too_many_prompts")
        # the published count lags a step; requests beyond the batch's seats will wait too
        queued = max(self.stats.num_waiting, len(self._streams) - seats, 0)
        new_waiting = max(0, num_requests - max(0, seats - len(self._streams)))
        if queued >= self.max_queued_requests or queued + new_waiting > self.max_queued_requests:
            raise QueueFullError(f"the server is busy: {queued} requests are already waiting "
                                 f"(--max-queued-requests {self.max_queued_requests}); retry later")

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; raises now (not on iteration) when the engine cannot take it.

        The prompt should already be checked with `engine.check_prompt` (the engine thread repeats the
        check; an error there surfaces from the stream)."""
        self.check_accepting()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.check_capacity(1)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        if self.listener is not None:
            self.listener.on_request(request_id, time.monotonic(), params)
        self._inbox.put((_ADD, request_id, prompt, params))
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they advance; aborts the request if the caller stops early or is cancelled."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._inbox.put((_ABORT, request_id))
            if self.listener is not None:
                self.listener.on_abort(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- engine thread -------------------------------------------------------------------------------

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _thread_main(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised on a thread
            log.error("model loading failed: %s", e, exc_info=not isinstance(e, FerryError))
            self._post(self._on_dead, e)
            return
        self.engine = engine
        self._max_num_seqs = engine.config.scheduler.max_num_seqs
        try:
            self.stats = self._snapshot(engine)  # /metrics has every series (offload counters at 0) before a request
            self._post(self._on_loaded)
            self._run(engine)
        except BaseException as e:  # noqa: BLE001
            log.exception("the engine loop died")
            self._post(self._on_dead, e)

    def _run(self, engine: LLMEngine) -> None:
        inbox = self._inbox
        failures = 0
        while True:
            cmds = []
            while not cmds and not engine.has_unfinished_requests():  # idle: block, never spin, but look at
                try:  # the engine's workers every second (a parallel engine's lost rank is found while idle)
                    cmds = [inbox.get(timeout=1.0)]
                except queue.Empty:
                    engine.check_health()
            try:
                while True:
                    cmds.append(inbox.get_nowait())
            except queue.Empty:
                pass
            errors = []
            for cmd in cmds:
                if cmd[0] == _ADD:
                    _, rid, prompt, params = cmd
                    try:
                        engine.add_request(prompt, params, rid)
                    except Exception as e:  # noqa: BLE001 - a refused request fails alone
                        errors.append((rid, e))
                elif cmd[0] == _ABORT:
                    engine.abort_request(cmd[1])
                else:
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                    self.stats = self._snapshot(engine)
                    engine.close()  # worker processes of a parallel engine, if any
                    return
            num_tokens = 0
            try:
                outputs = engine.step() if engine.has_unfinished_requests() else []
                num_tokens = engine.last_step_tokens
                failures = 0
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep the server
                failures += 1
                if failures >= MAX_STEP_FAILURES or getattr(e, "fatal", False):  # fatal: a parallel rank lost
                    raise
                log.exception("engine step failed (%d in a row); failing the requests in flight", failures)
                failed = list(engine.requests)
                for rid in failed:  # frees their KV blocks and state rows: the engine starts clean
                    engine.abort_request(rid)
                err = StepFailedError(f"the engine step failed: {type(e).__name__}: {e}")
                errors += [(rid, err) for rid in failed]
                outputs = []
            now = time.monotonic()
            self.stats = self._snapshot(engine)
            if outputs or errors or num_tokens:
                self._post(self._dispatch, outputs, errors, now, num_tokens)

    @staticmethod
    def _snapshot(engine: LLMEngine) -> EngineStats:
        sched, bm = engine.scheduler, engine.block_manager
        waiting = len({s.request_id for s in sched.waiting}) if sched.waiting else 0
        return EngineStats(
            num_running=len(engine.requests) - waiting, num_waiting=waiting, kv_cache_usage=bm.usage,
            num_preemptions=sched.num_preemptions, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, prompt_tokens=engine.stats["prompt_tokens"],
            generation_tokens=engine.stats["generation_tokens"],
            offload=None if engine.runner.placement.fully_resident else dataclasses.asdict(engine.runner.placed.stats))

    # -- callbacks on the event loop thread ----------------------------------------------------------

    def _on_loaded(self) -> None:
        if self.state == EngineState.LOADING:
            self.state = EngineState.READY
        if not self._loaded.done():
            self._loaded.set_result(None)

    def _on_dead(self, error: BaseException) -> None:
        self.state = EngineState.DEAD
        self.error = error
        if not self._loaded.done():
            self._loaded.set_exception(error)
            self._loaded.exception()  # mark retrieved: nobody may be awaiting it
        dead = EngineUnavailableError(f"the engine died: {error}")
        for stream in list(self._streams.values()):
            stream._fail(dead)
        self._streams.clear()

    def _dispatch(self, outputs: list[RequestOutput], errors: list, now: float, num_tokens: int = 0) -> None:
        streams = self._streams
        if self.listener is not None and num_tokens:
            self.listener.on_step(num_tokens)
        for rid, error in errors:
            stream = streams.get(rid)
            if stream is not None:
                stream._fail(error)
                if self.listener is not None:
                    self.listener.on_abort(rid)
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:  # else aborted meanwhile
                stream._put(out)
        if self.listener is not None and outputs:
            self.listener.on_outputs(outputs, now)
