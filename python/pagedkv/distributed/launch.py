"""Starting the ranks of a tensor-parallel engine, and the entry points of the workers (ranks > 0).

Two ways in:

- one machine: the driver (this process, rank 0) starts `tp - 1` worker
  processes with torch.multiprocessing (spawn); they meet on a free local
  TCP port. Like vLLM, a script that builds a tensor-parallel engine
  needs an `if __name__ == "__main__":` guard (spawn re-imports it).
- several machines: torchrun starts every rank with the standard
  MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE environment; rank 0 builds
  the engine (and serves), the others call `run_torchrun_worker` from the
  same command line (see `pagedkv.cli`).

This is plumbing: what a worker does once it has joined is the `serve`
callable it is given (`pagedkv.engine.worker.serve_steps`: its device side,
then the driver's steps). Spawned workers get it pickled, so it must be a
module-level function or a functools.partial of one.
"""

from __future__ import annotations

import logging
import signal
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.distributed.runtime import TPRuntime, torchrun_env

logger = logging.getLogger(__name__)

# What a worker runs once it has joined the group; returns the number of steps it ran.
ServeFn = Callable[[TPRuntime], int]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(world_size: int, device: str, serve: ServeFn) -> TPRuntime:
    """The driver's way in: joins torchrun's group, or spawns the `world_size - 1` workers of a one-machine group,
    each running `serve`."""
    env = torchrun_env()
    if env is not None:
        rank, world, local_rank, local_world = env
        if world != world_size:
            raise ValueError(f"tensor_parallel_size={world_size} but torchrun started {world} ranks (WORLD_SIZE): "
                             "they must be equal")
        if rank != 0:
            raise ValueError(f"rank {rank} is a worker: run it through `pagedkv` (which serves the steps of "
                             "rank 0), not LLMEngine")
        return TPRuntime.join(0, world, local_rank, local_world, "env://", device)
    if device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.SimpleQueue()
    workers = [ctx.Process(target=run_spawned_worker, args=(rank, world_size, init_method, device, serve, errors),
                           name=f"pagedkv-tp{rank}", daemon=True) for rank in range(1, world_size)]
    for w in workers:
        w.start()
    try:
        runtime = TPRuntime.join(0, world_size, 0, world_size, init_method, device)
    except Exception:
        for w in workers:
            w.kill()
        raise
    runtime.adopt_workers(workers, errors)
    return runtime


def run_spawned_worker(rank: int, world_size: int, init_method: str, device: str, serve: ServeFn,
                       errors: Any) -> None:
    """The entry point of a worker the driver spawned on this machine; a failure goes to `errors` as
    (rank, traceback) for the driver to report."""
    # Ctrl-C reaches the whole process group: the driver decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runtime = None
    try:
        runtime = TPRuntime.join(rank, world_size, rank, world_size, init_method, device)
        serve(runtime)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if runtime is not None:
            runtime.shutdown()


def run_torchrun_worker(world_size: int, device: str, serve: ServeFn) -> int:
    """The entry point of ranks > 0 under torchrun (`pagedkv serve|generate` calls it); returns an exit code."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError("run_torchrun_worker needs torchrun's RANK / WORLD_SIZE environment")
    rank, world, local_rank, local_world = env
    if world != world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} but torchrun started {world} ranks")
    runtime = TPRuntime.join(rank, world, local_rank, local_world, "env://", device)
    try:
        steps = serve(runtime)
    finally:
        runtime.shutdown()
    logger.info("tensor-parallel rank %d stops after %d steps", rank, steps)
    return 0
