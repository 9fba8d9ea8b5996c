"""`drive`: sends a planned list of requests at their offsets with a cap on requests in flight (open loop:
an arrival does not wait for earlier answers, only for a free slot), then lets the in-flight ones finish.

Bounded three ways: the plan's length, `until` (no request is sent after it, even one that waited for a
slot: it is recorded as cancelled, not sent), and the drain timeout; the session's stop event (Ctrl-C) ends sending and cancels what is in flight
at once. Every request's `Record` reaches the session, cancelled ones included. Does not know statistics.
"""

from __future__ import annotations

import asyncio

from ferrylm.bench.client import Client
from ferrylm.bench.record import Record
from ferrylm.bench.workload.prompts import Prompt


async def drive(session, client: Client, plan: list[tuple[float, int, Prompt]], concurrency: int,
                until: float | None = None, step: int = 0) -> list[Record]:
    """plan: (offset from now in seconds, request index, prompt), offsets ascending."""
    base = client.now()
    deadline = None if until is None else base + until
    slots = asyncio.Semaphore(concurrency)
    records: list[Record] = []
    tasks: set[asyncio.Task] = set()

    async def one(p: Prompt, rec: Record) -> None:
        try:
            await client.send(p, rec)
        finally:
            slots.release()
            session.live.inflight -= 1
            session.add(rec)

    for k, (offset, index, prompt) in enumerate(plan):
        wait = base + offset - client.now()
        if deadline is not None and base + offset >= deadline:
            break
        if wait > 0 and not await session.wait(asyncio.sleep(wait)):
            break
        if slots.locked():
            left = None if deadline is None else deadline - client.now()
            if not await session.wait(slots.acquire(), left, release=slots.release):
                if not session.stop.is_set():  # the run ended while arrivals still queued for a slot
                    unsent = [e for e in plan[k:] if base + e[0] < deadline]
                    for offset, index, prompt in unsent:
                        rec = Record(index, prompt.kind, base + offset, step, cancelled=True,
                                     error="not sent: still waiting for a free slot (--max-concurrency) at the end")
                        records.append(rec)
                        session.add(rec)
                break
        else:
            await slots.acquire()
        if session.stop.is_set():
            slots.release()
            break
        rec = Record(index, prompt.kind, base + offset, step)
        records.append(rec)
        session.live.sent += 1
        session.live.inflight += 1
        tasks.add(asyncio.create_task(one(prompt, rec)))

    if tasks and not session.stop.is_set():
        await session.wait(asyncio.wait(tasks), session.cfg.drain_timeout)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rec in records:
        if rec.sent is None and rec.error is None:  # cancelled before it started: it never reached `one`'s finally
            rec.cancelled = True
            session.live.inflight -= 1
            session.add(rec)
    return records
