"""Starting a parallel engine: `start_runner` gives the engine its runner (a plain `ModelRunner` in one
process; else rank 0's `ParallelExecutor` after spawning one worker process per other rank), and
`worker_main` / `serve` are a worker's whole life: join, build its `ModelRunner` on its shard, then run
each step rank 0 ships until told to stop.

Workers are spawned (torch.multiprocessing, `spawn`: CUDA cannot be forked), daemonic (they die with an
orderly exit of rank 0) and watch their parent (they exit within a second if rank 0 is killed). Under
torchrun (its RANK/WORLD_SIZE/MASTER_ADDR variables set) nothing is spawned: every process was started by
torchrun, rank 0 runs the command and the others serve steps (`torchrun_worker`).
It knows nothing about scheduling or sampling.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrylm.engine.model_runner import ModelRunner
from ferrylm.errors import ConfigError, FerryError, WorkerLostError
from ferrylm.parallel.dist import START_TIMEOUT, Dist, parent_watch, rank_device

log = logging.getLogger(__name__)

PING, STOP = "ping", "stop"
"""Control messages besides steps: keep the workers' wait for a step under the collective timeout; end."""


def torchrun_env() -> dict | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT when this process was started by torchrun."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys) or int(os.environ["WORLD_SIZE"]) < 2:
        return None
    return {k: os.environ[k] for k in keys}


def layout_check(model_config, parallel) -> None:
    """Refuses a TP x PP layout (`parallel`: a `ParallelConfig`) this model's structure cannot take: a model class
    without sharded layers, heads or KV heads (or, with expert_parallel, experts) that do not split over the TP ranks,
    fewer layers than stages. Reads nothing of the process or machine (`ferry plan` asks it of any layout)."""
    from ferrylm.layers.parallel_linear import kv_heads_per_rank
    from ferrylm.models.registry import model_class

    cls = model_class(model_config)
    if not getattr(cls, "tensor_parallel", False):  # sharded layers and the plain layer structure
        raise ConfigError(f"{cls.__name__} does not support tensor or pipeline parallelism yet (docs/parallel.md)")
    if parallel.pipeline_parallel_size > 1:
        from ferrylm.parallel.pipeline import stage_layers

        stage_layers(model_config.num_hidden_layers, parallel.pipeline_parallel_size, 0)
    if parallel.tensor_parallel_size > 1:
        tp, mc = parallel.tensor_parallel_size, model_config
        if mc.num_attention_heads % tp:
            raise ConfigError(f"the model's {mc.num_attention_heads} attention heads are not divisible by "
                              f"tensor_parallel_size {tp}")
        kv_heads_per_rank(mc.num_key_value_heads, tp)
        if parallel.expert_parallel and mc.is_moe and mc.num_experts % tp:
            raise ConfigError(f"the model's {mc.num_experts} experts are not divisible by tensor_parallel_size {tp}")


def _check(config, model_config) -> None:
    """What can be refused before any process starts: the layout (`layout_check`), then this process's
    environment (torchrun's process count, the GPUs torch sees)."""
    pc = config.parallel
    layout_check(model_config, pc)
    env = torchrun_env()
    if env and int(env["WORLD_SIZE"]) != pc.world_size:
        raise ConfigError(f"torchrun started {env['WORLD_SIZE']} processes but tensor_parallel_size x "
                          f"pipeline_parallel_size is {pc.world_size}")
    if config.device.startswith("cuda"):
        if ":" in config.device:
            raise ConfigError("with tensor_parallel_size > 1 give --device cuda (each rank takes its own GPU)")
        local = int(env["WORLD_SIZE"]) if env else pc.world_size
        n = torch.cuda.device_count()
        if env is None and n < local:
            raise ConfigError(f"tensor_parallel_size {pc.tensor_parallel_size} needs {local} GPUs, torch sees {n}")


def start_runner(config, model_config, source, max_model_len: int, progress=None):
    """The engine's runner: `ModelRunner` in one process; rank 0's `ParallelExecutor` otherwise."""
    if config.parallel.world_size == 1:
        return ModelRunner(config, model_config, source, max_model_len, progress=progress)
    from ferrylm.parallel.executor import ParallelExecutor
    from ferrylm.parallel.topology import device_order

    _check(config, model_config)
    world, env = config.parallel.world_size, torchrun_env()
    order = None if env else device_order(config, world)  # under torchrun LOCAL_RANK picks the GPU
    procs = {}
    if env:
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1  # torchrun's own store is on MASTER_PORT
        store = dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=START_TIMEOUT),
                              wait_for_workers=False)
        local_rank = int(env["LOCAL_RANK"])
    else:
        host, local_rank = "127.0.0.1", 0
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timedelta(seconds=START_TIMEOUT),
                              wait_for_workers=False)
        port = store.port
        ctx = torch.multiprocessing.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(target=worker_main, name=f"ferry-rank{r}", daemon=True,
                            args=(r, world, (host, port), _rank_config(config, r, order), max_model_len, os.getpid(),
                                  logging.getLogger("ferrylm").getEffectiveLevel()))
            p.start()
            procs[r] = p
    d = None
    try:
        config = _rank_config(config, local_rank, order)
        if config.numa_node is not None:
            from ferrylm.hw.cpu_binding import bind_cpu

            bind_cpu(config.threads, config.numa_node)
        d = Dist(0, world, store, (host, port), config, watch=_watch_procs(procs))
        runner = ModelRunner(config, model_config, source, max_model_len, progress=progress, dist=d)
    except BaseException:
        for p in procs.values():
            p.kill()
        if d is not None:
            d.close(abort=True)
        raise
    return ParallelExecutor(runner, d, procs)


def _rank_config(config, local_rank: int, order: list[int] | None):
    """A rank's own config: its device and (tp_groups auto on CUDA) its GPU's NUMA node."""
    from ferrylm.parallel.topology import numa_node_of

    device = rank_device(config.device, local_rank, order)
    numa = numa_node_of(config, int(device.split(":")[1])) if device.startswith("cuda") else config.numa_node
    return config.replace(device=device, numa_node=numa)


def _watch_procs(procs: dict):
    def watch():
        for r, p in procs.items():
            if p.exitcode is not None:
                raise WorkerLostError(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} while starting")
    return watch


def _threads(config, world: int) -> None:
    if config.device == "cpu" and config.threads is None:  # the host's cores shared among its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _build(rank: int, world: int, addr, config, max_model_len: int, watch) -> tuple[Dist, ModelRunner]:
    from ferrylm.config import ModelConfig
    from ferrylm.hw.cpu_binding import bind_cpu
    from ferrylm.weights.source import open_source

    bind_cpu(config.threads, config.numa_node)
    _threads(config, world)
    store = dist.TCPStore(addr[0], addr[1], world, is_master=False, timeout=timedelta(seconds=START_TIMEOUT))
    d = Dist(rank, world, store, addr, config, watch=watch)
    try:
        source = open_source(config.model)
        if config.dequantize:
            source.get_quantized = lambda name: None
        try:
            model_config = ModelConfig.from_hf(source.config)
            if max_model_len is None:  # a torchrun worker: the rule LLMEngine uses (its checks ran on rank 0)
                max_model_len = config.scheduler.max_model_len or model_config.context_limit
            runner = ModelRunner(config, model_config, source, max_model_len, dist=d)
        finally:
            source.close()
    except BaseException as e:
        d.report(e)
        raise
    return d, runner


def worker_main(rank: int, world: int, addr, config, max_model_len: int, parent_pid: int,
                log_level: int = logging.WARNING) -> None:
    """A spawned worker's whole life; it logs at rank 0's level for `ferrylm` (`ferry`'s $FERRY_LOG_LEVEL and -v,
    or what a library user set on the `ferrylm` logger)."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    watch = parent_watch(parent_pid)

    def orphan_guard():  # rank 0 killed: nobody will stop us, so go now
        import time

        while True:
            try:
                watch()
            except WorkerLostError:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=orphan_guard, daemon=True, name="ferry-orphan-guard").start()
    try:
        d, runner = _build(rank, world, addr, config, max_model_len, watch)
    except FerryError as e:
        log.error("%s", e)
        sys.exit(1)
    sys.exit(serve(d, runner))


def serve(d: Dist, runner: ModelRunner) -> int:
    """Run every step rank 0 ships until STOP; the exit status (0 on STOP)."""
    try:
        while True:
            msg = d.recv()
            if msg == STOP:
                break
            if msg == PING:
                continue
            runner.run_shipped(msg)
    except Exception as e:  # noqa: BLE001 - rank 0 gone, a collective timed out, or the step failed here
        log.error("rank %d stops: %s: %s", d.rank, type(e).__name__, e)
        d.report(e)
        d.close(abort=True)
        return 1
    d.close()
    return 0


def torchrun_worker(config, max_model_len: int | None = None) -> int:
    """A torchrun process of rank > 0: build this rank's runner and serve steps (the command does not run)."""
    env = torchrun_env()
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    config = config.replace(device=rank_device(config.device, int(env["LOCAL_RANK"])))
    d, runner = _build(rank, world, (env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1), config, max_model_len, None)
    return serve(d, runner)
