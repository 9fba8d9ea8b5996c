"""`Session`: one `ferry bench` run from start to files on disk.

Owns: reaching the server and picking the model, building the prompts, the clock (t0), the results folder
and its raw records file (one JSON line per request, written as each finishes, so a killed run keeps what
it did), Ctrl-C (the first stops sending, cancels what is in flight and still writes everything; a second
one quits at once), the live view, and writing the summary (summary.json, and as the last stdout line) and
the plots. The levels (latency, load, soak) decide what to send and what to add to the summary.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from ferrylm.bench import BenchError
from ferrylm.bench.client import Client, auth_headers
from ferrylm.bench.config import BenchConfig
from ferrylm.bench.progress import LiveView
from ferrylm.bench.record import Record
from ferrylm.bench.report import brief
from ferrylm.bench.workload.dataset import load_dataset
from ferrylm.bench.workload.prompts import Prompt, synthetic_prompts
from ferrylm.bench.workload.tokens import make_counter


def _utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def prepare(cfg: BenchConfig, needed: int) -> tuple[str | None, list[Prompt], str]:
    """(model, prompts, how prompt tokens were counted); fails clearly if the server cannot be reached."""
    with httpx.Client(base_url=cfg.base_url, headers=auth_headers(cfg), timeout=30) as http:
        try:
            r = http.get("/v1/models")
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach the server at {cfg.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code == 401:
            raise BenchError(f"{cfg.base_url}/v1/models answered 401: give the API key (--api-key or OPENAI_API_KEY)")
        if r.status_code >= 500:  # e.g. still loading: its /tokenize would fail too and prompts be mis-sized
            raise BenchError(f"the server at {cfg.base_url} is not ready: /v1/models answered HTTP {r.status_code}")
        model = cfg.model
        if model is None and r.status_code == 200:
            try:
                ids = [m.get("id") for m in (r.json().get("data") or []) if isinstance(m, dict)]
            except (ValueError, AttributeError):
                ids = []
            model = next((i for i in ids if i), None)
        try:
            counter = make_counter(http, model, cfg.tokenizer)
            n = max(1, min(cfg.num_prompts, needed))
            if cfg.progress:
                print(f"ferry bench: building {n} prompts (tokens counted by {counter.name})", file=sys.stderr)
            if cfg.dataset:
                prompts = load_dataset(cfg.dataset, n, counter, cfg.seed)
            else:
                prompts = synthetic_prompts(n, cfg.prompt_tokens, cfg.mix, counter, cfg.seed)
        except httpx.HTTPError as e:
            raise BenchError(f"the server at {cfg.base_url} went away while prompts were built: {e}") from None
    return model, prompts, counter.name


class Session:
    def __init__(self, cfg: BenchConfig, level: str):
        self.cfg, self.level = cfg, level
        self.started = _utc()
        self.out = Path(cfg.out or f"bench-results/{level}-{self.started:%Y%m%d-%H%M%S}")
        self.out.mkdir(parents=True, exist_ok=True)
        self.records: list[Record] = []
        self.live = LiveView(cfg.progress)
        self.interrupted = False
        self.t0 = time.perf_counter()
        self._raw = open(self.out / "records.jsonl", "w", encoding="utf-8")
        self.stop: asyncio.Event | None = None
        self._ticker: asyncio.Future | None = None

    # -- inside the event loop ---------------------------------------------------------------------------

    def open(self) -> None:
        self.stop = asyncio.Event()
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._interrupt)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
        self.live.start()
        self._ticker = asyncio.ensure_future(self._tick()) if self.cfg.progress else None

    async def _tick(self) -> None:
        while True:  # the bar moves with time too, not only when a request ends
            await asyncio.sleep(0.5)
            self.live.refresh()

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        self.live.stop()
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError):
            pass

    def _interrupt(self) -> None:
        self.interrupted = True
        self.stop.set()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)  # a second Ctrl-C quits at once
        print("ferry bench: interrupted, writing what there is (Ctrl-C again to quit now)", file=sys.stderr)

    async def wait(self, aw, timeout: float | None = None, release=None) -> bool:
        """Await `aw` unless the stop event or the timeout comes first (then cancel it); True if it finished.
        `release` undoes an acquire that finished in the same instant as the stop."""
        task = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if task.done() and not task.cancelled() and not self.stop.is_set():
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if release is not None and task.done() and not task.cancelled():
            release()
        return False

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        self._raw.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
        self._raw.flush()
        self.live.finished((rec.output_tokens or 0) if rec.ok else 0, rec.ttft if rec.ok else None, rec.ok)

    def client(self, model: str | None) -> Client:
        return Client(self.cfg, model, self.t0)

    # -- results -------------------------------------------------------------------------------------

    def header(self, model: str | None, counter: str) -> dict:
        cfg = asdict(self.cfg)
        cfg.pop("api_key", None)
        return {"bench": self.level, "url": self.cfg.base_url, "model": model, "api": self.cfg.api,
                "started_at": self.started.isoformat(timespec="seconds"), "out": str(self.out),
                "prompt_tokens_counted_by": counter, "config": cfg}

    def write_json(self, name: str, obj) -> None:
        tmp = self.out / (name + ".tmp")
        tmp.write_text(json.dumps(clean(obj), indent=1, ensure_ascii=False, allow_nan=False, default=_jsonable) + "\n",
                       encoding="utf-8")
        tmp.replace(self.out / name)

    def finish(self, summary: dict) -> None:
        self._raw.close()
        summary["interrupted"] = self.interrupted
        summary["finished_at"] = _utc().isoformat(timespec="seconds")
        self.write_json("summary.json", summary)
        for label, block in [("", summary.get("results"))] + [(f"rate {s['rate']:g}: ", s) for s in summary.get("steps", [])]:
            if block:
                print(f"ferry bench {self.level}: {brief(block, label)}", file=sys.stderr)
        if "soak" in summary:
            checks = ", ".join(f"{k} {v}" for k, v in summary["soak"]["checks"].items())
            print(f"ferry bench soak: verdict {summary['soak']['verdict']} ({checks})", file=sys.stderr)
        print(f"ferry bench: results in {self.out}", file=sys.stderr)
        print(json.dumps(clean(summary), ensure_ascii=False, allow_nan=False, default=_jsonable))


def _jsonable(x):
    return str(x)


def clean(obj):
    """Strict JSON: infinities as "inf" (an unbounded rate), NaN as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else (None if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def run(cfg: BenchConfig, level: str, needed: int, body) -> dict:
    """Prepare, then run `body(session, client, prompts) -> dict` in an event loop; write the results.

    `body` returns the level's part of the summary; the session adds the header, writes summary.json,
    prints it as the last stdout line and returns it.
    """
    model, prompts, counter = prepare(cfg, needed)
    s = Session(cfg, level)
    summary = s.header(model, counter)
    summary["prompts"] = {"distinct": len(prompts), "kinds": sorted({p.kind for p in prompts}),
                          "tokens_min": min(p.tokens for p in prompts), "tokens_max": max(p.tokens for p in prompts)}

    async def main():
        s.open()
        client = s.client(model)
        try:
            return await body(s, client, prompts)
        finally:
            s.close()
            await client.aclose()

    s.t0 = time.perf_counter()
    summary.update(asyncio.run(main()))
    s.finish(summary)
    return summary
