"""Dist: one process's place in a parallel engine. The process groups (NCCL between GPUs, gloo on the
CPU; a separate gloo group carries the control channel), the step channel from rank 0 to every worker,
and start-up synchronisation through the rendezvous store.

Start-up syncs go through the store, polled, not through collectives: ranks load weights at different
speeds, and a rank that fails or dies while loading is named at once (its error is left in the store)
instead of surfacing as a collective timeout. After start-up every collective waits at most
`parallel_timeout` seconds. Each rank also stamps `alive/<rank>` in the store every second, so rank 0 can
say which rank stopped answering. It knows nothing about models, steps' contents or the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrylm.errors import WorkerLostError
from ferrylm.parallel.group import TPGroup

log = logging.getLogger(__name__)

START_TIMEOUT = 1800.0
"""Seconds the slowest rank may take to start and load its weights."""
ALIVE_EVERY = 1.0
"""Seconds between a rank's `alive/<rank>` stamps."""


def rank_device(device: str, local_rank: int, order: list[int] | None = None) -> str:
    """The device of a rank on its host: cpu, or cuda:<the rank's GPU> (`order`: the topology's)."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{order[local_rank] if order else local_rank}"


class Dist:
    def __init__(self, rank: int, world: int, store, store_addr: tuple[str, int], config, watch=None):
        """Join the world: wait (polling) until every rank is up, then form the process groups.
        `watch()` raises when a peer is known to be gone (rank 0: a worker process exited; a spawned
        worker: its parent exited)."""
        pc = config.parallel
        self.rank, self.world, self.store, self.watch = rank, world, store, watch
        self._closed = threading.Event()
        self.timeout = pc.parallel_timeout
        self._stamp = threading.Thread(target=self._stamp_alive, args=(store_addr,), daemon=True, name="ferry-alive")
        self._stamp.start()
        self.sync("started")
        device = torch.device(config.device)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=self.timeout)
        # process groups of our own (not torch.distributed's global default group), so two engines can live
        # in one process (tests) and nothing global is left behind when an engine closes
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, timeout)
        """Steps and pings from rank 0 (gloo: plain Python objects, whatever the data backend)."""
        tp, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.stage, tp_rank = divmod(rank, tp)
        """Ranks are stage-major: stage s holds ranks s * tp .. s * tp + tp - 1, one tensor-parallel group."""
        self.world_pg = _data_group(self.backend, dist.PrefixStore("world", store), rank, world, timeout)
        """Every rank, on the data backend: hidden states between stages, logits back to rank 0."""
        tp_pg = self.world_pg if self.pp_size == 1 else _data_group(
            self.backend, dist.PrefixStore(f"tp{self.stage}", store), tp_rank, tp, timeout)
        self.tp = TPGroup(tp_rank, tp, [tp_pg], pc.expert_parallel)
        last = (self.pp_size - 1) * tp
        self.logits_pg = _data_group(self.backend, dist.PrefixStore("logits", store), int(rank == last), 2, timeout) \
            if self.pp_size > 1 and rank in (0, last) else None
        """Rank 0 and the last stage's first rank: logits come back on a group (a stream, under NCCL) of their
        own, so they never queue behind the hidden states rank 0 is still sending (a cycle on one stream)."""

    # -- start-up -----------------------------------------------------------------------------------

    def _stamp_alive(self, addr: tuple[str, int]) -> None:
        store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=10))  # its own socket
        while not self._closed.is_set():
            try:
                store.set(f"alive/{self.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone; `watch` ends this process
                return
            self._closed.wait(ALIVE_EVERY)

    def sync(self, tag: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until every rank reached `tag`; a rank that reported an error or died fails it, naming it."""
        self.store.set(f"{tag}/{self.rank}", "1")
        keys = [f"{tag}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            self.raise_reported()
            if self.watch:
                self.watch()
            if time.monotonic() > deadline:
                late = [r for r in range(self.world) if not self.store.check([keys[r]])]
                raise WorkerLostError(f"rank(s) {late} did not reach {tag!r} within {timeout:g} s")
            time.sleep(0.05)

    def report(self, error: BaseException) -> None:
        """Leave this rank's failure in the store for rank 0 to name."""
        try:
            self.store.set(f"error/{self.rank}", f"{type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - nobody left to tell
            pass

    def reported(self, rank: int) -> str | None:
        try:
            return self.store.get(f"error/{rank}").decode() if self.store.check([f"error/{rank}"]) else None
        except Exception:  # noqa: BLE001
            return None

    def raise_reported(self) -> None:
        for r in range(self.world):
            if r != self.rank and (err := self.reported(r)):
                raise WorkerLostError(f"rank {r} failed: {err}")

    def silent_ranks(self, older_than: float = 3 * ALIVE_EVERY) -> list[int]:
        """Ranks whose alive stamp is older than `older_than` seconds (hung, stopped or gone)."""
        now, out = time.time(), []
        for r in range(self.world):
            try:
                if now - float(self.store.get(f"alive/{r}").decode()) > older_than:
                    out.append(r)
            except Exception:  # noqa: BLE001
                out.append(r)
        return out

    def min_int(self, n: int) -> int:
        """The smallest `n` over all ranks (e.g. KV blocks every rank can hold)."""
        t = torch.tensor([n], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    # -- the step channel ---------------------------------------------------------------------------

    def send(self, msg) -> None:
        """Rank 0: one message (a step, PING or STOP) to every worker: its pickle's length, then its bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
        self.control.broadcast(torch.tensor([data.numel()], dtype=torch.long), 0).wait()
        self.control.broadcast(data, 0).wait()

    def recv(self):
        """A worker: the next message from rank 0 (blocks up to `parallel_timeout`; rank 0 pings when idle)."""
        n = torch.zeros(1, dtype=torch.long)
        self.control.broadcast(n, 0).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    # -- pipeline stages ----------------------------------------------------------------------------

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    # Tags: 2 * micro-batch for hidden states, 2 * micro-batch + 1 for logits. Sends return their `Work`
    # (the tensor must live until it is waited on), so a stage computes its next micro-batch meanwhile.

    def send_next(self, x: torch.Tensor, mb: int = 0):
        """Hidden states to the same tensor-parallel rank of the next stage."""
        return self.world_pg.send([x], self.rank + self.tp.size, 2 * mb)

    def recv_prev(self, shape, dtype, device, mb: int = 0) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        self.world_pg.recv([x], self.rank - self.tp.size, 2 * mb).wait()
        return x

    def send_logits(self, logits: torch.Tensor, mb: int = 0):
        """The last stage's first rank: a micro-batch's logits to rank 0, which samples."""
        return self.logits_pg.send([logits], 0, 2 * mb + 1)

    def recv_logits(self, shape, device, mb: int = 0) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        self.logits_pg.recv([out], 1, 2 * mb + 1).wait()
        return out

    def close(self, abort: bool = False) -> None:
        """Shut the groups down (abort them after a failure: a peer may never answer); their sockets close,
        so peers still waiting on them fail at once. Layers keep their `TPGroup`, so the backends must be
        shut here, not left to the garbage collector at interpreter exit."""
        self._closed.set()
        self._stamp.join(5)
        groups = {id(g): g for g in (self.control, self.world_pg, *self.tp.backend, self.logits_pg) if g is not None}
        for g in groups.values():
            try:
                g.abort() if abort else g.shutdown()
            except Exception as e:  # noqa: BLE001 - already broken: nothing more to release
                log.debug("process group %s: %s", "abort" if abort else "shutdown", e)
        # drop every reference now (layers hold the TP group's box), so the backends and the store are
        # destroyed here, their threads joined, rather than during interpreter exit
        groups.clear()
        self.tp.backend.clear()
        self.control = self.world_pg = self.logits_pg = self.store = None


def _data_group(backend: str, store, rank: int, world: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def parent_watch(parent_pid: int):
    """For a spawned worker: raises once its parent (rank 0) is gone (it was re-parented)."""
    def watch():
        if os.getppid() != parent_pid:
            raise WorkerLostError("rank 0 exited")
    return watch
