"""Sizing the KV-cache pool (pagedkv.engine.memory_pool): bytes per token and block, budgets, fits.

Pure functions of configs and measured numbers: no model, no engine. The device queries a CUDA
budget makes are stood in for, so the arithmetic is checked on any machine.
"""

from __future__ import annotations

import builtins
import io

import pytest
import torch
from pagedkv.config import CacheConfig, GiB, SchedulerConfig
from pagedkv.engine import memory_pool
from pagedkv.engine.memory_pool import (
    KVCacheSpec,
    check_fits,
    cpu_kv_budget,
    kv_cache_spec,
    local_num_blocks,
    needs_activation_profile,
    plan_kv_cache,
    tokens_held_at_most,
)
from pagedkv.model_config import ModelConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def llama_7b() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128)


@pytest.mark.parametrize("cache_dtype,per_token", [("auto", 524_288), ("fp8", 262_144), ("fp8_e5m2", 262_144),
                                                   ("int8_per_token_head", 270_336),
                                                   ("int4_per_token_head", 139_264)])
def test_a_7b_llama_token_in_each_cache_dtype(cache_dtype, per_token):
    """The module docstring's figures: 2 x 32 layers x 32 heads x (128 values + a 4-byte scale pair where
    per token and head)."""
    spec = kv_cache_spec(llama_7b(), torch.float16, 16, cache_dtype=cache_dtype)
    assert spec.bytes_per_token == per_token
    assert spec.bytes_per_block == 16 * per_token
    assert spec.cache_dtype == ("fp8_e4m3" if cache_dtype == "fp8" else cache_dtype)
    assert spec.bytes_for(1024) == 1024 * per_token  # 64 whole blocks
    assert spec.bytes_for(1025) == 65 * 16 * per_token  # a started block counts whole
    assert spec.bytes_for(0) == 0


def test_tensor_parallel_ranks_hold_their_share_of_kv_heads():
    full = kv_cache_spec(llama_7b(), torch.float16, 16).bytes_per_token
    assert kv_cache_spec(llama_7b(), torch.float16, 16, tensor_parallel_size=4).bytes_per_token == full // 4


def test_num_blocks_is_whole_blocks_and_never_negative():
    spec = KVCacheSpec(bytes_per_token=100, block_size=4)
    assert spec.num_blocks(1200) == 3
    assert spec.num_blocks(1199) == 2
    assert spec.num_blocks(399) == 0
    assert spec.num_blocks(-5000) == 0  # a CUDA budget the weights already overran


def _meminfo(monkeypatch, text: str | None):
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/meminfo":
            if text is None:
                raise OSError("no /proc here")
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)


def test_available_ram_reads_memavailable_in_kib(monkeypatch):
    _meminfo(monkeypatch, "MemTotal:       24683832 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    assert memory_pool.available_ram() == 20_000_000 * 1024


def test_available_ram_falls_back_to_physical_memory(monkeypatch):
    _meminfo(monkeypatch, None)
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}
    monkeypatch.setattr(memory_pool.os, "sysconf", sizes.__getitem__)
    assert memory_pool.available_ram() == 4096 * 1000


@pytest.mark.parametrize("ram,ranks,budget", [(100 * GiB, 1, 4 * GiB), (6 * GiB, 1, 3 * GiB),
                                              (6 * GiB, 2, 3 * GiB // 2), (8 * GiB, 1, 4 * GiB),
                                              (9 * GiB, 2, 9 * GiB // 4)])
def test_cpu_budget_is_4_gib_at_most_half_the_available_ram_shared_by_ranks(monkeypatch, ram, ranks, budget):
    monkeypatch.setattr(memory_pool, "available_ram", lambda: ram)
    assert cpu_kv_budget(None, ranks) == budget
    assert cpu_kv_budget(12345, ranks) == 12345  # kv_cache_memory wins, RAM or not


def test_cpu_budget_default_is_one_rank(monkeypatch):
    monkeypatch.setattr(memory_pool, "available_ram", lambda: 6 * GiB)
    assert cpu_kv_budget(None) == 3 * GiB


def test_cuda_budget_subtracts_weights_other_processes_and_the_activation_peak(monkeypatch):
    """total 80 GiB, 60 free, torch reserved 12 (of which 10 allocated: the weights): others hold 8."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * GiB)
    budget = memory_pool.cuda_kv_budget(0.9, 2 * GiB, CUDA)
    assert budget == int(80 * GiB * 0.9) - 8 * GiB - 10 * GiB - 2 * GiB


def test_needs_activation_profile_only_on_cuda_without_kv_cache_memory():
    assert needs_activation_profile(CacheConfig(), CUDA)
    assert not needs_activation_profile(CacheConfig(kv_cache_memory=GiB), CUDA)
    assert not needs_activation_profile(CacheConfig(), CPU)


def test_local_num_blocks_on_each_device(monkeypatch):
    spec = KVCacheSpec(bytes_per_token=1024, block_size=16)  # 16 KiB a block
    assert local_num_blocks(spec, CacheConfig(kv_cache_memory=GiB), CPU) == GiB // (16 * 1024)
    assert local_num_blocks(spec, CacheConfig(kv_cache_memory=GiB), CUDA) == GiB // (16 * 1024)
    monkeypatch.setattr(memory_pool, "available_ram", lambda: 4 * GiB)
    assert local_num_blocks(spec, CacheConfig(), CPU, ranks_on_host=2) == GiB // (16 * 1024)
    assert local_num_blocks(spec, CacheConfig(), CPU) == 2 * GiB // (16 * 1024)  # one rank unless told
    seen = {}

    def budget(utilization, peak, device):
        seen.update(utilization=utilization, peak=peak)
        return 2 * GiB

    monkeypatch.setattr(memory_pool, "cuda_kv_budget", budget)
    assert local_num_blocks(spec, CacheConfig(gpu_memory_utilization=0.5), CUDA, activation_peak=777) == \
        2 * GiB // (16 * 1024)
    assert seen == {"utilization": 0.5, "peak": 777}
    local_num_blocks(spec, CacheConfig(), CUDA)
    assert seen == {"utilization": 0.9, "peak": 0}  # no peak measured: nothing subtracted


def test_tokens_held_without_a_window_is_max_model_len_in_whole_blocks():
    assert tokens_held_at_most(100, 16, None, 512) == 112
    assert tokens_held_at_most(96, 16, None, 512) == 96
    assert tokens_held_at_most(96, 16, 0, 512) == 96


def test_tokens_held_with_a_window_is_the_window_and_a_chunk():
    """Window 10, chunk 7, block 4: keys span 10 - 1 + 7 = 16 positions = 4 blocks, +1 where the
    window's start falls inside a block: 5 blocks, 20 tokens."""
    assert tokens_held_at_most(4096, 4, 10, 7) == 20
    assert tokens_held_at_most(4096, 4, 10, 8) == 24  # 17 positions: 5 blocks + 1
    assert tokens_held_at_most(16, 4, 10, 8) == 16  # never more than max_model_len's blocks


def test_check_fits_at_the_exact_size_and_one_block_short():
    spec = KVCacheSpec(bytes_per_token=8, block_size=16)
    check_fits(spec, num_blocks=8, watermark_blocks=0, max_model_len=128, setting="kv_cache_memory")
    check_fits(spec, num_blocks=10, watermark_blocks=2, max_model_len=128, setting="kv_cache_memory")
    message = (r"the KV cache holds 112 tokens \(9 blocks of 16, 8 bytes a token in kv_cache_dtype auto\), fewer "
               r"than max_model_len=128: raise kv_cache_memory or lower max_model_len")
    with pytest.raises(ValueError, match=message):
        check_fits(spec, num_blocks=9, watermark_blocks=2, max_model_len=128, setting="kv_cache_memory")
    with pytest.raises(ValueError, match=r"holds 0 tokens .* raise gpu_memory_utilization"):
        check_fits(spec, num_blocks=1, watermark_blocks=3, max_model_len=128, setting="gpu_memory_utilization")


def test_check_fits_with_a_window_asks_for_the_window_and_a_chunk():
    spec = KVCacheSpec(bytes_per_token=8, block_size=4)
    check_fits(spec, 5, 0, 4096, "kv_cache_memory", sliding_window=10, max_chunk=7)  # 20 tokens, see above
    with pytest.raises(ValueError, match=r"fewer than the 20 one sequence of this sliding-window model \(window 10\)"):
        check_fits(spec, 4, 0, 4096, "kv_cache_memory", sliding_window=10, max_chunk=7)
    # A max_model_len below what the window could span asks for max_model_len alone, in its own words.
    check_fits(spec, 3, 0, 10, "kv_cache_memory", sliding_window=10, max_chunk=7)
    with pytest.raises(ValueError, match=r"fewer than max_model_len=10"):
        check_fits(spec, 2, 0, 10, "kv_cache_memory", sliding_window=10, max_chunk=7)
    # The default chunk is one token (a decoding sequence): window 9 spans 9 positions, 3 blocks + 1;
    # window 8 spans 8, 2 blocks + 1.
    check_fits(spec, 4, 0, 4096, "kv_cache_memory", sliding_window=9)
    with pytest.raises(ValueError, match=r"fewer than the 16 one sequence"):
        check_fits(spec, 3, 0, 4096, "kv_cache_memory", sliding_window=9)
    check_fits(spec, 3, 0, 4096, "kv_cache_memory", sliding_window=8)


def _plan(num_blocks: int, device=CPU, window=None, **kw):
    cache = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    spec = KVCacheSpec(bytes_per_token=1024, block_size=8)  # 8 KiB a block
    return plan_kv_cache(spec, num_blocks, CacheConfig(block_size=8, **cache), SchedulerConfig(**kw), device, window)


def test_plan_counts_swap_blocks_only_in_swap_mode():
    plan = _plan(64, max_model_len=64, preemption_mode="swap", swap_space=0.25)
    assert (plan.num_blocks, plan.num_cpu_blocks) == (64, GiB // 4 // 8192)
    assert _plan(64, max_model_len=64, preemption_mode="recompute", swap_space=0.25).num_cpu_blocks == 0


def test_plan_keeps_the_watermark_out_of_a_sequence_reach():
    """watermark 0.25 of 20 blocks = 5: 15 blocks (120 tokens) for one sequence."""
    _plan(20, max_model_len=120, watermark=0.25)
    with pytest.raises(ValueError, match=r"holds 120 tokens \(20 blocks of 8"):
        _plan(20, max_model_len=121, watermark=0.25)


def test_plan_sizes_a_window_model_by_its_largest_chunk():
    """Window 10, block 8, max_model_len 4096: a chunk of 7 spans 16 positions (3 blocks with the
    window's start inside one: 24 tokens), a chunk of 8 spans 17 (4 blocks). The chunk is
    max_num_batched_tokens, or the smaller long_prefill_token_threshold where one is set."""
    kw = dict(max_model_len=4096, max_num_seqs=4, window=10)
    _plan(3, max_num_batched_tokens=7, **kw)
    with pytest.raises(ValueError, match=r"the 32 one sequence"):
        _plan(3, max_num_batched_tokens=8, **kw)
    _plan(3, max_num_batched_tokens=64, long_prefill_token_threshold=7, **kw)
    with pytest.raises(ValueError, match=r"the 24 one sequence"):  # the threshold never raises the chunk
        _plan(2, max_num_batched_tokens=7, long_prefill_token_threshold=64, **kw)


def test_plan_names_the_setting_that_sized_the_pool():
    with pytest.raises(ValueError, match=r"raise kv_cache_memory"):
        _plan(2, max_model_len=64)
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization"):
        _plan(2, device=CUDA, max_model_len=64)
    with pytest.raises(ValueError, match=r"raise kv_cache_memory"):
        _plan(2, device=CUDA, max_model_len=64, kv_cache_memory=8192)
