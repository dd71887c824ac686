"""The device side of one rank: its model, its KV-cache plan and its ModelRunner, built the same way on every rank.

The driver (LLMEngine) and every tensor-parallel worker build it with
`build_device_side`, so the ranks meet the same collectives in the same
order: the barrier once every shard is loaded, the activation profile's
forward (CUDA), the minimum over ranks of the block count, and the capture
of the decode graphs (which hold the model's collectives).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedkv import host_memory
from pagedkv.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.distributed.runtime import TPRuntime
from pagedkv.engine.memory_pool import (
    KVCachePlan,
    kv_cache_spec,
    local_num_blocks,
    needs_activation_profile,
    plan_kv_cache,
)
from pagedkv.engine.model_runner import ModelRunner, check_kv_cache_dtype, profile_activation_peak
from pagedkv.lora.manager import LoRAManager
from pagedkv.model.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DeviceSide:
    """What one rank runs steps with. block_manager: the driver's (None on a worker, which gets its batches built)."""

    loaded: LoadedModel
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    plan: KVCachePlan
    block_manager: BlockManager | None
    runner: ModelRunner


def build_device_side(args: EngineArgs, tp: TPRuntime | None = None, loaded: LoadedModel | None = None) -> DeviceSide:
    """Loads the model onto this rank's device (unless `loaded`), plans the KV cache with the other ranks, and
    builds the ModelRunner (with the block manager and the step channel on the driver).

    tp: this process's tensor-parallel membership (None on one device). Only the
    driver loads a tokenizer.
    """
    driver = tp is None or tp.is_driver
    loaded = loaded or LoadedModel.load(args, tp.device if tp else None, with_tokenizer=driver)
    if loaded.device.type == "cpu" and host_memory.keep_freed_activations():
        logger.info("host malloc keeps freed activations (mmap threshold %d MiB, trim threshold %d MiB)",
                    host_memory.MMAP_THRESHOLD_BYTES >> 20, host_memory.TRIM_THRESHOLD_BYTES >> 20)
    cc, sc = args.cache_config(), args.scheduler_config(loaded.model.config)
    check_kv_cache_dtype(cc.cache_dtype, loaded.model.config.head_dim, cc.block_size)
    if tp is not None:
        tp.barrier()  # every rank has its shard
    # The adapters' slots before the cache is sized: on CUDA the pool gets the memory they leave.
    lora_config = args.lora_config()
    lora = None
    if lora_config is not None:
        on_load = tp.channel.send_lora if tp is not None and driver else None
        lora = LoRAManager(loaded.model, lora_config, loaded.dtype, loaded.device, on_load)
    plan = _plan_cache(loaded, cc, sc, args.seed, tp)
    cc.num_gpu_blocks, cc.num_cpu_blocks = plan.num_blocks, plan.num_cpu_blocks
    bm = (BlockManager(cc.block_size, plan.num_blocks, plan.num_cpu_blocks, cc.watermark, cc.enable_prefix_caching,
                       cc.hash_algo, sliding_window=loaded.model.config.kv_sliding_window) if driver else None)
    runner = ModelRunner(loaded.model, bm, cc, sc, plan.num_blocks, plan.num_cpu_blocks, loaded.dtype,
                         loaded.device, args.seed, tp.channel if tp is not None and driver else None,
                         cuda_graphs=not args.enforce_eager)
    runner.eos_token_ids = loaded.eos_token_ids
    runner.lora = lora
    return DeviceSide(loaded, cc, sc, plan, bm, runner)


def _plan_cache(loaded: LoadedModel, cc: CacheConfig, sc: SchedulerConfig, seed: int,
                tp: TPRuntime | None) -> KVCachePlan:
    """Every rank measures its own budget (its free memory, its activation peak); all take the smallest count."""
    spec = kv_cache_spec(loaded.model.config, loaded.dtype, cc.block_size, tp.world_size if tp else 1,
                         cc.cache_dtype)
    peak = (profile_activation_peak(loaded.model, cc, sc, loaded.dtype, loaded.device, seed)
            if needs_activation_profile(cc, loaded.device) else 0)
    num_blocks = local_num_blocks(spec, cc, loaded.device, peak, tp.local_world_size if tp else 1)
    if tp is not None:
        num_blocks = tp.min_over_ranks(num_blocks)
    return plan_kv_cache(spec, num_blocks, cc, sc, loaded.device, loaded.model.config.kv_sliding_window)
