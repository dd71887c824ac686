"""Sizing the KV-cache memory pool: bytes per token and per block, and how many blocks fit.

KV bytes per token = 2 (K and V) x layers x KV heads x bytes per token and
head (per device: a tensor-parallel rank holds its share of the KV heads).
Bytes per token and head depend on the cache dtype (`kv_cache_dtype`,
pagedkv.kv_cache): head_dim x the compute dtype's bytes for "auto", head_dim
for fp8, head_dim (int8) or head_dim / 2 (int4) plus a 4-byte (scale, zero)
pair for the per-token-head formats. A 7B Llama (32 layers, 32 KV heads,
head_dim 128, fp16) takes 524,288 bytes a token, 536,870,912 for a
1024-token sequence; 262,144 a token in fp8, 139,264 in int4.
The CPU swap pool uses the same format, so its blocks are the same bytes.

The budget: on CUDA, gpu_memory_utilization x total device memory, minus the
weights, minus the activation peak of a profiling forward at
max_num_batched_tokens; on the CPU, `kv_cache_memory` bytes (default 4 GiB,
at most half the available RAM). `kv_cache_memory` overrides both.

Pure sizing: the caller hands in what it measured (the activation peak) and
what it knows of the tensor-parallel group (its size, the ranks on this
host), and agrees on one block count with the other ranks itself
(`pagedkv.engine.device_setup`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagedkv.config import CacheConfig, GiB, ModelConfig, SchedulerConfig
from pagedkv.kv_cache import kv_cache_format

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * GiB


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Per-device footprint of the paged KV cache of one model."""

    bytes_per_token: int
    block_size: int
    cache_dtype: str = "auto"  # the kv_cache_dtype the bytes are counted for (canonical name)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)

    def bytes_for(self, num_tokens: int) -> int:
        """Bytes that `num_tokens` tokens of one sequence occupy, whole blocks counted."""
        return -(-num_tokens // self.block_size) * self.bytes_per_block


def kv_cache_spec(cfg: ModelConfig, dtype: torch.dtype, block_size: int, tensor_parallel_size: int = 1,
                  cache_dtype: str = "auto") -> KVCacheSpec:
    """The one place bytes per token / per block are computed (the engine and sizing tools share it).

    dtype: the compute dtype (what "auto" stores); cache_dtype: the kv_cache_dtype (scale planes counted).
    """
    name = kv_cache_format(cache_dtype).name
    return KVCacheSpec(cfg.kv_bytes_per_token(dtype, tensor_parallel_size, name), block_size, name)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (bytes), or total physical memory where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_kv_budget(kv_cache_memory: int | None, ranks_on_host: int = 1) -> int:
    """Bytes for one rank's KV cache on the CPU: the request, else 4 GiB, capped at half the available RAM
    (shared by the tensor-parallel ranks on this host)."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    return min(DEFAULT_CPU_KV_CACHE_MEMORY, available_ram() // 2 // ranks_on_host)


def cuda_kv_budget(gpu_memory_utilization: float, activation_peak: int, device: torch.device) -> int:
    """utilization x total device memory - what torch holds now (weights) - the profiled activation peak."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    budget = int(total * gpu_memory_utilization) - used_by_others - weights - activation_peak
    logger.info("CUDA memory: total %.2f GiB x %.2f, weights %.2f GiB, activation peak %.2f GiB, other %.2f GiB "
                "-> KV cache %.2f GiB", total / GiB, gpu_memory_utilization, weights / GiB, activation_peak / GiB,
                used_by_others / GiB, budget / GiB)
    return budget


def tokens_held_at_most(max_model_len: int, block_size: int, sliding_window: int | None, max_chunk: int) -> int:
    """Most token slots one sequence holds at once (whole blocks): max_model_len, or with a sliding window W the
    blocks of one chunk's keys, from the earliest query's window start to the chunk's end:
    ceil((W - 1 + max_chunk) / block_size) + 1 blocks (the +1: the window start falls inside a block)."""
    full = -(-max_model_len // block_size) * block_size
    if not sliding_window:
        return full
    return min(full, (-(-(sliding_window - 1 + max_chunk) // block_size) + 1) * block_size)


def check_fits(spec: KVCacheSpec, num_blocks: int, watermark_blocks: int, max_model_len: int, setting: str,
               sliding_window: int | None = None, max_chunk: int = 1) -> None:
    """Refuses a pool that cannot hold even one sequence at its largest, naming what to change.

    Without a window that is a max_model_len sequence; with one, a chunk of
    `max_chunk` tokens and the window before it (`tokens_held_at_most`).
    """
    usable = (num_blocks - watermark_blocks) * spec.block_size
    needed = tokens_held_at_most(max_model_len, spec.block_size, sliding_window, max_chunk)
    needed = min(needed, max_model_len)
    if usable < needed:
        what = (f"max_model_len={max_model_len}" if needed == max_model_len else
                f"the {needed} one sequence of this sliding-window model (window {sliding_window}) can hold at once")
        raise ValueError(
            f"the KV cache holds {max(usable, 0)} tokens ({num_blocks} blocks of {spec.block_size}, "
            f"{spec.bytes_per_token} bytes a token in kv_cache_dtype {spec.cache_dtype}), fewer than {what}: "
            f"raise {setting} or lower max_model_len")


@dataclass(slots=True, frozen=True)
class KVCachePlan:
    """How many blocks this engine's pool gets (per device), and its CPU swap pool."""

    spec: KVCacheSpec
    num_blocks: int
    num_cpu_blocks: int


def needs_activation_profile(cache_config: CacheConfig, device: torch.device) -> bool:
    """Whether the budget depends on the activation peak (CUDA, sized by gpu_memory_utilization)."""
    return device.type == "cuda" and cache_config.kv_cache_memory is None


def local_num_blocks(spec: KVCacheSpec, cache_config: CacheConfig, device: torch.device, activation_peak: int = 0,
                     ranks_on_host: int = 1) -> int:
    """Blocks this device's budget holds. activation_peak: bytes (counted only where needs_activation_profile)."""
    cc = cache_config
    if needs_activation_profile(cc, device):
        return spec.num_blocks(cuda_kv_budget(cc.gpu_memory_utilization, activation_peak, device))
    return spec.num_blocks(cpu_kv_budget(cc.kv_cache_memory, ranks_on_host))


def plan_kv_cache(spec: KVCacheSpec, num_blocks: int, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                  device: torch.device, sliding_window: int | None = None) -> KVCachePlan:
    """The plan for `num_blocks` GPU blocks (under tensor parallelism the smallest of the ranks' local counts:
    they hold the same share of KV heads, so one count fits all); refuses a pool too small for one sequence
    (max_model_len, or with `sliding_window` (ModelConfig.kv_sliding_window) a window and a step's chunk)."""
    cc, sc = cache_config, scheduler_config
    setting = "gpu_memory_utilization" if needs_activation_profile(cc, device) else "kv_cache_memory"
    max_chunk = min(sc.max_num_batched_tokens, sc.long_prefill_token_threshold or sc.max_num_batched_tokens)
    check_fits(spec, num_blocks, int(cc.watermark * num_blocks), sc.max_model_len, setting, sliding_window, max_chunk)
    num_cpu_blocks = spec.num_blocks(int(cc.swap_space * GiB)) if sc.preemption_mode == "swap" else 0
    return KVCachePlan(spec, num_blocks, num_cpu_blocks)
