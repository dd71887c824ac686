"""A tensor-parallel worker (rank > 0): loads its shard, sizes its cache with the others, runs the driver's steps.

It has no scheduler, block manager or sampler: each step arrives from the
driver as block ops plus a flat batch (`StepChannel.recv`), and the worker
runs the same copies and the same forward, taking part in its collectives.
It stops when the driver says so, or when the driver is gone (its
collectives fail).
"""

from __future__ import annotations

import logging
import signal
import traceback
from typing import TYPE_CHECKING

import torch

from pagedkv.distributed.runtime import TPRuntime, torchrun_env

if TYPE_CHECKING:
    from pagedkv.config import EngineArgs

logger = logging.getLogger(__name__)


def serve_steps(runtime: TPRuntime, args: EngineArgs) -> int:
    """Set-up in the driver's order of collectives, then the step loop. Returns the number of steps run."""
    from pagedkv.engine.memory_pool import plan_kv_cache
    from pagedkv.engine.model_runner import ModelRunner
    from pagedkv.model.loader import LoadedModel

    loaded = LoadedModel.load(args, runtime.device, with_tokenizer=False)
    cache_config = args.cache_config()
    scheduler_config = args.scheduler_config(loaded.model.config)
    runtime.barrier()  # every rank has its shard
    plan = plan_kv_cache(loaded.model, cache_config, scheduler_config, loaded.dtype, loaded.device, args.seed,
                         runtime)
    runner = ModelRunner(loaded.model, None, cache_config, scheduler_config, plan.num_blocks, plan.num_cpu_blocks,
                         loaded.dtype, loaded.device, args.seed, cuda_graphs=not args.enforce_eager)
    steps = 0
    with torch.inference_mode():
        while (message := runtime.channel.recv()) is not None:
            runner.run_batch(*message, checked=True)  # the driver checked it before sending
            steps += 1
    return steps


def run_spawned_worker(rank: int, world_size: int, init_method: str, args: EngineArgs, errors) -> None:
    """The entry point of a worker the driver spawned on this machine."""
    # Ctrl-C reaches the whole process group: the driver decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runtime = None
    try:
        runtime = TPRuntime.join(rank, world_size, rank, world_size, init_method, args.device)
        serve_steps(runtime, args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if runtime is not None:
            runtime.shutdown()


def run_torchrun_worker(args: EngineArgs) -> int:
    """The entry point of ranks > 0 under torchrun (`pagedkv serve|generate` calls it); returns an exit code."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError("run_torchrun_worker needs torchrun's RANK / WORLD_SIZE environment")
    rank, world, local_rank, local_world = env
    if world != args.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} but torchrun started {world} ranks")
    runtime = TPRuntime.join(rank, world, local_rank, local_world, "env://", args.device)
    try:
        steps = serve_steps(runtime, args)
    finally:
        runtime.shutdown()
    logger.info("tensor-parallel rank %d stops after %d steps", rank, steps)
    return 0
