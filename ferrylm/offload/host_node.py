"""Host work in the GPU's stream order, inside CUDA graphs too: a stream hands work to a host thread and
waits for it, without the host thread ever blocking on the GPU or the GPU's queue being drained.

`HostHandoff` owns two POSIX semaphores. `post(stream)` enqueues `sem_post(start)` and `wait(stream)`
enqueues `sem_wait(done)` as host functions (`cuLaunchHostFunc`): the CUDA driver's host-function thread
runs them when the stream reaches them, so the stream stops at `wait` until the worker calls `done()`,
while the kernels enqueued between `post` and `wait` run beside the worker. Both functions are libc's own
(no Python, no GIL on the driver's thread), and stream capture records them as host nodes, so a replayed
graph hands off the same way. The worker side (`take()` / `done()`) are ctypes calls, which release the GIL.

The stream must not be made to wait for a worker that will never answer: the worker answers every
`take()` with `done()`, on error too. A signal handled on the driver's host-function thread would end a
`sem_wait` early (POSIX does not restart it); the process's signal handlers run on the main thread in
CPython, but a library that installs its own could reach that thread.
It knows nothing about experts; `offload/expert_cache.py` uses it for the hybrid decode path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

_SEM_BYTES = 64  # sizeof(sem_t) is 32 on x86-64 and 64-bit Arm glibc: room to spare


class _Libs:
    libc = None
    cuda = None

    @classmethod
    def load(cls):
        if cls.libc is None:
            cls.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            for f in ("sem_init", "sem_post", "sem_wait", "sem_destroy"):
                getattr(cls.libc, f).argtypes = [ctypes.c_void_p] + ([ctypes.c_int, ctypes.c_uint] if f == "sem_init" else [])
                getattr(cls.libc, f).restype = ctypes.c_int
        if cls.cuda is None and torch.cuda.is_available():
            cls.cuda = ctypes.CDLL("libcuda.so.1")
            cls.cuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            cls.cuda.cuLaunchHostFunc.restype = ctypes.c_int
        return cls


class Semaphore:
    """A process-private POSIX semaphore at a stable address (the driver's thread is handed the address)."""

    def __init__(self):
        self.lib = _Libs.load().libc
        self.buf = ctypes.create_string_buffer(_SEM_BYTES)
        self.addr = ctypes.addressof(self.buf)
        if self.lib.sem_init(self.addr, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self) -> None:
        self.lib.sem_post(self.addr)

    def wait(self) -> None:
        while self.lib.sem_wait(self.addr) != 0:  # EINTR: a signal arrived on this thread; wait again
            if ctypes.get_errno() != 4:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _fn(name: str) -> int:
    return ctypes.cast(getattr(_Libs.load().libc, name), ctypes.c_void_p).value


class HostHandoff:
    def __init__(self):
        self.start, self.finish = Semaphore(), Semaphore()
        self.closed = False
        """Set (then `start` posted) to end the worker."""
        self._post, self._wait = _fn("sem_post"), _fn("sem_wait")

    def _launch(self, stream: torch.cuda.Stream, fn: int, sem: Semaphore) -> None:
        r = _Libs.load().cuda.cuLaunchHostFunc(stream.cuda_stream, fn, sem.addr)
        if r != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {r}")

    def post(self, stream: torch.cuda.Stream) -> None:
        """Enqueue: wake the worker (its `take()` returns) when the stream gets here."""
        self._launch(stream, self._post, self.start)

    def wait(self, stream: torch.cuda.Stream) -> None:
        """Enqueue: the stream stops here until the worker calls `done()`."""
        self._launch(stream, self._wait, self.finish)

    def take(self) -> None:
        """Worker side: block until the stream has passed a `post` (GIL released while blocked)."""
        self.start.wait()

    def done(self) -> None:
        """Worker side: release the stream from its `wait`."""
        self.finish.post()
