"""Fault injection during a soak (`--chaos cpu-load,net-delay,net-drop`), on this machine only, bounded and undone.

- cpu-load: one busy-loop process per CPU core while the fault is on (killed by pid when it ends).
- net-delay: the bench talks to the server through a local TCP proxy that, while the fault is on, holds every
  chunk of bytes from the server for `delay` seconds before passing it on.
- net-drop: through the same proxy, while the fault is on, each request (the first bytes the client sends
  after a response) is picked with probability `drop` (seeded by --seed) to have its response cut: the proxy
  passes a random 0..1023 bytes of it, drops the rest and resets both sides, so the client sees a refused or
  broken stream and the server a vanished client. The cuts' times are kept, so the soak's server-error check
  can tell these injected failures (excused) from the server's own.
- disk-fill: in a directory the server writes to (`--chaos-dir`: its temp or log folder, ideally a small
  tmpfs), one file of `--chaos-fill-size` bytes (written until then or until the disk is full) in `bytes/`,
  and `--chaos-fill-files` empty files (until then or until the inodes run out) in `inodes/`; each phase runs
  even if the other hit a full disk; all removed when it ends. Bounded by those sizes, never by "the whole
  disk" unless the folder's file system is that small.
The faults run one after another in the last two thirds of the soak, each on for the first half of its slot
and followed by the other half to recover; the first third is the baseline. Per fault the report gives the
requests sent while it was on, their error rate and E2E P50 / P99, and the time to recover: from the fault's
end to the first request sent after it whose E2E is within the baseline's P99.

Not here: whether the server logs a clear error when it cannot write its logs (a bench run does not own the
server's log; docs/bench.md says what `ferry serve` does and how it is tested).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
import subprocess
import sys
from urllib.parse import urlparse

from ferrylm.bench import BenchError
from ferrylm.bench.record import Record
from ferrylm.bench.stats import percentile

FAULTS = ("cpu-load", "net-delay", "net-drop", "disk-fill")
CUT_WITHIN = 1024
"""net-drop passes at most this many bytes of a picked response before cutting it."""


class Proxy:
    """127.0.0.1:<free port> -> the server. While `delay` > 0 each chunk from the server waits that long; while
    `drop` > 0 each request's response is cut with that probability (seeded) within its first CUT_WITHIN bytes."""

    def __init__(self, target: str, seed: int = 0, now=None):
        u = urlparse(target)
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.scheme = u.scheme
        self.delay = 0.0
        self.drop = 0.0
        self.rng = random.Random(seed)
        self.now = now or (lambda: 0.0)
        self.cuts: list[float] = []
        """When (on `now`'s clock) each picked response was cut."""
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"{self.scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        # one exchange at a time on a kept-alive connection: a request's first bytes roll the dice once
        state = {"rolled": False, "budget": None}

        def cut() -> None:
            self.cuts.append(self.now())
            writer.transport.abort()  # a reset, not a clean close: the client must see a broken stream
            up_w.transport.abort()

        async def pipe(src, dst, from_server: bool):
            try:
                while data := await src.read(65536):
                    if not from_server:
                        if not state["rolled"]:
                            picked = self.drop > 0 and self.rng.random() < self.drop
                            state["budget"] = self.rng.randrange(CUT_WITHIN) if picked else None
                        state["rolled"] = True
                    else:
                        state["rolled"] = False
                        if self.delay > 0:
                            await asyncio.sleep(self.delay)
                        if state["budget"] is not None:
                            if len(data) > state["budget"]:
                                dst.write(data[: state["budget"]])
                                cut()
                                return
                            state["budget"] -= len(data)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class DiskFill:
    """A size-capped file and a count-capped set of empty files in `folder`, removed by `undo`."""

    def __init__(self, folder: str, size: float, files: int):
        if not os.path.isdir(folder):
            raise BenchError(f"--chaos-dir {folder}: no such directory (disk-fill writes there)")
        self.root = os.path.join(folder, f"ferry-bench-fill-{os.getpid()}")
        self.size, self.files = int(size), files
        self.written = self.created = 0
        self.full = False
        """The byte phase stopped because the disk was full."""
        self.inodes_out = False
        """The inode phase stopped because the file system had no inodes (or no room for entries) left."""
        self.stopped = False
        """Set by `undo`: a fill still running in its thread stops at its next block."""

    def do(self) -> None:
        """Both phases, each until its cap or until the file system refuses (ENOSPC / EDQUOT: the fault)."""
        os.makedirs(self.root, exist_ok=True)
        self.full = self._phase(self._fill_bytes)
        self.inodes_out = self._phase(self._fill_inodes)

    def _phase(self, fill) -> bool:
        try:
            fill()
            return False
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            if self.stopped:  # undo removed the folder under us
                return False
            raise

    def _fill_bytes(self) -> None:
        os.makedirs(os.path.join(self.root, "bytes"), exist_ok=True)
        block = b"\0" * (1 << 20)
        with open(os.path.join(self.root, "bytes", "fill"), "wb") as f:
            while self.written < self.size and not self.stopped:
                self.written += f.write(block[: min(len(block), self.size - self.written)])
                f.flush()  # a full disk shows here, in this block, not in close
            os.fsync(f.fileno())

    def _fill_inodes(self) -> None:
        folder = os.path.join(self.root, "inodes")
        os.makedirs(folder, exist_ok=True)
        for i in range(self.files):
            if self.stopped:
                break
            open(os.path.join(folder, f"i{i}"), "wb").close()
            self.created += 1

    def undo(self) -> None:
        self.stopped = True
        shutil.rmtree(self.root, ignore_errors=True)


class Chaos:
    def __init__(self, faults: tuple[str, ...], target: str, delay: float, folder: str | None = None,
                 fill_size: float = 1e9, fill_files: int = 100_000, drop: float = 0.5, seed: int = 0, now=None):
        bad = [f for f in faults if f not in FAULTS]
        if bad:
            raise BenchError(f"unknown --chaos fault {bad[0]!r}: choose from {', '.join(FAULTS)}")
        if "disk-fill" in faults and not folder:
            raise BenchError("--chaos disk-fill needs --chaos-dir: the server's temp or log folder")
        self.faults, self.delay, self.drop = faults, delay, drop
        self.disk = DiskFill(folder, fill_size, fill_files) if "disk-fill" in faults else None
        net = "net-delay" in faults or "net-drop" in faults
        self.proxy = Proxy(target, seed, now) if net else None
        self.burners: list[subprocess.Popen] = []
        self.windows: list[tuple[str, float, float]] = []

    async def start(self) -> str | None:
        """The URL to send requests to (the proxy's), or None to keep the server's."""
        return await self.proxy.start() if self.proxy else None

    def plan(self, start: float, duration: float) -> list[tuple[str, float, float]]:
        slot = duration * 2 / 3 / len(self.faults)
        base = start + duration / 3
        self.windows = [(f, base + k * slot, base + k * slot + slot / 2) for k, f in enumerate(self.faults)]
        return self.windows

    def _on(self, fault: str) -> None:
        if fault == "cpu-load":
            self.burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(os.cpu_count() or 1)]
        elif fault == "net-delay":
            self.proxy.delay = self.delay
        elif fault == "net-drop":
            self.proxy.drop = self.drop

    def _off(self, fault: str) -> None:
        if fault == "cpu-load":
            for p in self.burners:
                p.kill()
            for p in self.burners:
                p.wait()
            self.burners = []
        elif fault == "net-delay" and self.proxy:
            self.proxy.delay = 0.0
        elif fault == "net-drop" and self.proxy:
            self.proxy.drop = 0.0
        elif fault == "disk-fill" and self.disk:
            self.disk.undo()

    async def run(self, now, wait) -> None:
        """Switch each fault on and off at its window; `wait(seconds) -> bool` is False once the run stops."""
        for fault, t0, t1 in self.windows:
            if not await wait(max(0.0, t0 - now())):
                return
            self._on(fault)
            if fault == "disk-fill":  # writing a GB takes a while: off the event loop, and undone if stopped
                await asyncio.get_running_loop().run_in_executor(None, self.disk.do)
            try:
                if not await wait(max(0.0, t1 - now())):
                    return
            finally:
                self._off(fault)

    def excused(self, r: Record) -> bool:
        """A failed request that the proxy cut on purpose (a cut between its send and its end)."""
        if self.proxy is None or r.ok or r.cancelled or r.sent is None:
            return False
        end = r.end if r.end is not None else r.sent
        return any(r.sent <= t <= end for t in self.proxy.cuts)

    async def close(self) -> None:
        for fault in self.faults:
            self._off(fault)
        if self.proxy:
            await self.proxy.close()


def report(records: list[Record], windows: list[tuple[str, float, float]], baseline_end: float,
           disk: DiskFill | None = None, chaos: Chaos | None = None) -> dict:
    done = [r for r in records if r.sent is not None and not r.cancelled]
    base = [r.e2e for r in done if r.ok and r.sent < baseline_end]
    bar = percentile(base, 99)
    out = {"baseline": {"requests": len(base), "e2e_p99": bar}, "faults": []}
    for fault, t0, t1 in windows:
        during = [r for r in done if t0 <= r.sent < t1]
        ok = [r for r in during if r.ok]
        after = sorted((r for r in done if r.sent >= t1), key=lambda r: r.sent)
        back = next((r for r in after if r.ok and bar is not None and r.e2e <= bar), None)
        out["faults"].append({"fault": fault, "start": t0, "end": t1, "requests": len(during),
                              "error_rate": (len(during) - len(ok)) / len(during) if during else None,
                              "e2e_p50": percentile([r.e2e for r in ok], 50),
                              "e2e_p99": percentile([r.e2e for r in ok], 99),
                              "recovered_after_s": None if back is None else back.sent - t1})
        if fault == "disk-fill" and disk is not None:
            out["faults"][-1].update({"bytes_written": disk.written, "files_created": disk.created,
                                      "disk_full": disk.full, "inodes_out": disk.inodes_out,
                                      "left_behind": os.path.exists(disk.root)})
        if fault == "net-drop" and chaos is not None and chaos.proxy is not None:
            failed = [r for r in during if not r.ok]
            out["faults"][-1].update({"drop": chaos.drop, "cuts": len(chaos.proxy.cuts),
                                      "failed_by_cuts": sum(map(chaos.excused, failed)),
                                      "errors": sorted({(r.error or "")[:80] for r in failed})})
    return out
