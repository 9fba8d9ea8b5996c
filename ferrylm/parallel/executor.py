"""ParallelExecutor: rank 0's runner of a parallel engine. It looks like a `ModelRunner` to the engine
(every attribute is rank 0's runner's), but `execute` first ships the step's plain description
(`StepInput`) to every worker, which runs the same `ModelRunner.run` on its shard; the logits come back
gathered on rank 0.

It watches the workers: a monitor thread pings them when no step went out for a quarter of the collective
timeout (so an idle worker's wait never times out) and notices a worker process that exits within half a
second. Any failure - a dead or hung rank, a collective timeout, a worker's own error - becomes one
`WorkerLostError` naming the rank, the remaining workers are stopped, and every later call raises it.
`close()` (also at interpreter exit) stops the workers; nothing is left running.
It knows nothing about scheduling or sampling.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch

from ferrylm.engine.model_runner import ModelRunner
from ferrylm.errors import WorkerLostError
from ferrylm.parallel.dist import Dist
from ferrylm.parallel.launch import PING, STOP

log = logging.getLogger(__name__)


class ParallelExecutor:
    def __init__(self, runner: ModelRunner, dist: Dist, procs: dict):
        self.runner, self.dist, self.procs = runner, dist, procs
        """procs: rank -> spawned worker process (empty under torchrun)."""
        self.failed: WorkerLostError | None = None
        self._lock = threading.Lock()  # one message at a time on the control group
        self._fail_lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = False
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="ferry-parallel-monitor")
        self._monitor.start()
        atexit.register(self.close)
        log.info("parallel engine: %d ranks (tensor-parallel %d%s), %s, workers %s", dist.world, dist.tp.size,
                 ", expert-parallel" if dist.tp.expert_parallel else "", dist.backend,
                 {r: p.pid for r, p in procs.items()} or "started by torchrun")

    def __getattr__(self, name):  # kv_cache, state_pool, placement, model, ...: rank 0's runner's
        return getattr(self.runner, name)

    # -- steps --------------------------------------------------------------------------------------

    def execute(self, out, extra_rows: list[int] = ()) -> torch.Tensor:
        self.check_health()
        step = self.runner.describe(out, extra_rows)
        try:
            self._send(step)
            return self.runner.run_shipped(step)
        except WorkerLostError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.distributed raises RuntimeError subclasses
            raise self._fail(e) from None

    def _send(self, msg) -> None:
        with self._lock:
            self.dist.send(msg)
            self._last_send = time.monotonic()

    def check_health(self) -> None:
        """Raises the `WorkerLostError` once any rank is lost."""
        if self.failed is not None:
            raise self.failed

    # -- failures -----------------------------------------------------------------------------------

    def _diagnose(self, error: BaseException | None) -> str:
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                + (f" ({err})" if (err := self.dist.reported(r)) else "")
                for r, p in self.procs.items() if p.exitcode is not None]
        if dead:
            return "; ".join(dead)
        failed = [f"rank {r} failed: {err}" for r in range(1, self.dist.world) if (err := self.dist.reported(r))]
        if failed:
            return "; ".join(failed)
        silent = [r for r in self.dist.silent_ranks() if r != 0]
        if silent:
            return f"rank(s) {silent} stopped answering (hung or unreachable; collective timeout " \
                   f"{self.dist.timeout:g} s)" + (f": {error}" if error else "")
        return f"a collective failed: {error}"

    def _fail(self, error: BaseException | None) -> WorkerLostError:
        with self._fail_lock:
            if self.failed is None:
                # a peer's death reaches us as a socket error a moment before its exit status does
                deadline = time.monotonic() + 1.0
                while not any(p.exitcode is not None for p in self.procs.values()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.failed = WorkerLostError(f"parallel engine lost a worker: {self._diagnose(error)}; "
                                              f"the engine cannot continue")
                log.error("%s", self.failed)
                self._stop_workers(kill=True)
        return self.failed

    def _watch(self) -> None:
        ping_every = self.dist.timeout / 4
        while not self._closed and self.failed is None:
            time.sleep(0.5)
            if self._closed:
                return
            if any(p.exitcode is not None for p in self.procs.values()):
                self._fail(None)
                return
            if time.monotonic() - self._last_send > ping_every and self._lock.acquire(blocking=False):
                try:
                    self.dist.send(PING)
                    self._last_send = time.monotonic()
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
                    return
                finally:
                    self._lock.release()

    # -- shutdown -----------------------------------------------------------------------------------

    def _stop_workers(self, kill: bool) -> None:
        for p in self.procs.values():
            if kill and p.exitcode is None:
                p.kill()
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1)

    def close(self) -> None:
        """Stop the workers (STOP, then kill whatever has not exited within 5 s) and leave the groups."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.failed is None:
            try:
                with self._lock:
                    self.dist.send(STOP)
            except Exception as e:  # noqa: BLE001 - a worker already gone: it is killed below
                log.debug("stop message: %s", e)
        self._stop_workers(kill=self.failed is not None)
        self.dist.close(abort=self.failed is not None)
        if self.failed is None and hasattr(self.runner, "close"):  # rank 0's own shard (a failed group: left as it is)
            self.runner.close()
