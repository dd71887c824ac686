"""The prefix cache's host and disk tiers in the engine, on the default model (pagedkv.engine.kv_offload).

Greedy outputs must be identical with and without the tiers (under
preemption by recompute and by swap, and chunked prefill); the disk tier
must serve a restart, never use a corrupted, truncated, renamed or foreign
file, keep tenants apart, and let two engines share one directory.
"""

from __future__ import annotations

import os
import random
import stat

import pytest
from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineArgs

BS = 16
PREFIX = 5 * BS  # tokens of each shared prefix


def params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make(loaded_model, blocks: int, **kw) -> LLM:
    """An engine whose pool holds `blocks` blocks (the default model, float32)."""
    per_block = loaded_model.model.config.num_hidden_layers * 2 * loaded_model.model.num_kv_heads * \
        loaded_model.model.config.head_dim * 4 * BS
    kw.setdefault("max_model_len", 128)
    return LLM(loaded_model=loaded_model, kv_cache_memory=blocks * per_block, enable_prefix_caching=True,
               block_size=BS, **kw)


def block_bytes(loaded_model) -> int:
    cfg = loaded_model.model.config
    return cfg.num_hidden_layers * 2 * loaded_model.model.num_kv_heads * cfg.head_dim * 4 * BS


def conversations(seed: int = 0, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(PREFIX)] for _ in range(n)]


def run_rounds(llm: LLM, prefixes: list[list[int]], rounds: int = 2) -> list[list[int]]:
    """Each round asks every prefix with a new suffix, one request at a time: each prefix's blocks are evicted
    from a small pool before its next turn."""
    outs = []
    for r in range(rounds):
        for i, p in enumerate(prefixes):
            prompt = p + [200 + 7 * r + i, 300 + r]
            outs.append(llm.generate([{"prompt_token_ids": prompt}], params(), use_tqdm=False)[0].outputs[0].token_ids)
    return outs


@pytest.fixture(scope="module")
def baseline(loaded_model):
    llm = make(loaded_model, 12)
    try:
        return run_rounds(llm, conversations())
    finally:
        llm.shutdown()


def test_host_tier_restores_evicted_prefixes_with_identical_outputs(loaded_model, baseline):
    llm = make(loaded_model, 12, kv_offloading_size=40 * block_bytes(loaded_model) / 2**30)
    try:
        assert run_rounds(llm, conversations()) == baseline
        s = llm.get_stats()
        # The pool (12 blocks) cannot keep four 5-block prefixes; the tier brings every second-round one back.
        assert s.tier_hits_host == 4 * PREFIX and s.kv_restored_blocks_host == 4 * PREFIX // BS
        assert s.kv_offloaded_blocks >= 4 * PREFIX // BS and s.kv_host_bytes_moved > 0
        assert s.tier_queries > 0
        llm.llm_engine.block_manager.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_tier_under_preemption_and_chunked_prefill(loaded_model, mode):
    """Several requests at once through a pool too small for them: preemption, chunked prefill (a 32-token
    budget) and tier restores in the same steps; outputs equal the engine's without the tier."""
    prefixes = conversations(1, n=3)
    prompts = [{"prompt_token_ids": p + [400 + i, 500 + r]} for r in range(2) for i, p in enumerate(prefixes)]
    kw = dict(max_num_batched_tokens=32, max_num_seqs=3, preemption_mode=mode, swap_space=0.05)

    def run(**extra):
        llm = make(loaded_model, 14, **kw, **extra)
        try:
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params(8), use_tqdm=False)]
            outs += [o.outputs[0].token_ids for o in llm.generate(prompts[3:], params(8), use_tqdm=False)]
            llm.llm_engine.block_manager.check_invariants()
            return outs, llm.get_stats()
        finally:
            llm.shutdown()

    base, s0 = run()
    tiered, s1 = run(kv_offloading_size=40 * block_bytes(loaded_model) / 2**30)
    assert tiered == base
    assert s1.tier_hits_host > 0


def test_disk_tier_serves_a_restart(loaded_model, baseline, tmp_path):
    first = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        assert run_rounds(first, conversations(), rounds=1) == baseline[:4]
    finally:
        first.shutdown()
    dirs = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(dirs) == 1 and stat.S_IMODE(dirs[0].stat().st_mode) == 0o700
    files = list(dirs[0].glob("*/*.kvb"))
    assert len(files) == 4 * PREFIX // BS and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    restarted = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        out = restarted.generate([{"prompt_token_ids": conversations()[0] + [200, 300]}], params(), use_tqdm=False)
        assert out[0].outputs[0].token_ids == baseline[0]
        assert out[0].num_cached_tokens == PREFIX
        s = restarted.get_stats()
        assert s.tier_hits_disk == PREFIX and s.kv_disk_bytes_read > 0 and s.kv_disk_files_rejected == 0
    finally:
        restarted.shutdown()


def _corrupt(files: list) -> None:
    """Flips a payload byte of the first file, truncates the second, and gives the third the fourth's name."""
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:-100])
    os.replace(files[2], files[3])


def test_disk_tier_never_uses_a_bad_file(loaded_model, baseline, tmp_path):
    first = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        run_rounds(first, conversations()[:1], rounds=1)
    finally:
        first.shutdown()
    directory = next(d for d in tmp_path.iterdir() if d.is_dir())
    llm = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        hashes = llm.llm_engine.block_manager.prefix_cache.prompt_hashes(conversations()[0] + [200, 300])
        files = [directory / h.hex()[:2] / f"{h.hex()}.kvb" for h in hashes]
        assert all(f.exists() for f in files)
        _corrupt([files[1], files[2], files[3], files[4]])  # block 0 stays good
        out = llm.generate([{"prompt_token_ids": conversations()[0] + [200, 300]}], params(), use_tqdm=False)
        assert out[0].outputs[0].token_ids == baseline[0]
        s = llm.get_stats()
        assert s.tier_hits_disk == BS  # the good first block only: the chain ends at the corrupted second
        assert s.kv_disk_files_rejected == 1 and out[0].num_cached_tokens == BS
    finally:
        llm.shutdown()


def test_disk_tier_is_per_model_setting_and_per_tenant(loaded_model, baseline, tmp_path):
    first = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    prompt = [{"prompt_token_ids": conversations()[0] + [200, 300]}]
    try:
        first.generate(prompt, params(), use_tqdm=False, cache_salt="tenant-a")
    finally:
        first.shutdown()
    other_setting = make(loaded_model, 12, kv_cache_dir=str(tmp_path), kv_cache_dtype="int8_per_token_head")
    try:
        other_setting.generate(prompt, params(), use_tqdm=False, cache_salt="tenant-a")
        assert other_setting.get_stats().tier_hits_disk == 0
    finally:
        other_setting.shutdown()
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2  # one directory per setting
    same = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        out = same.generate(prompt, params(), use_tqdm=False, cache_salt="tenant-b")
        assert same.get_stats().tier_hits_disk == 0 and out[0].outputs[0].token_ids == baseline[0]
        same.generate(prompt, params(), use_tqdm=False, cache_salt="tenant-a")
        assert same.get_stats().tier_hits_disk == PREFIX
    finally:
        same.shutdown()


def test_two_engines_share_one_directory(loaded_model, baseline, tmp_path):
    a = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    b = make(loaded_model, 12, kv_cache_dir=str(tmp_path))
    try:
        prefixes = conversations()
        a.generate([{"prompt_token_ids": prefixes[0] + [200, 300]}], params(), use_tqdm=False)
        b.generate([{"prompt_token_ids": prefixes[1] + [201, 300]}], params(), use_tqdm=False)
        a.llm_engine.kv_offload.disk.flush()
        b.llm_engine.kv_offload.disk.flush()
        out_a = a.generate([{"prompt_token_ids": prefixes[1] + [201, 300]}], params(), use_tqdm=False)
        out_b = b.generate([{"prompt_token_ids": prefixes[0] + [200, 300]}], params(), use_tqdm=False)
        assert out_a[0].outputs[0].token_ids == baseline[1] and out_b[0].outputs[0].token_ids == baseline[0]
        assert a.get_stats().tier_hits_disk == PREFIX and b.get_stats().tier_hits_disk == PREFIX
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("kw, match", [
    ({"kv_offloading_size": 1.0}, "enable_prefix_caching"),
    ({"kv_cache_dir": "/tmp/x"}, "enable_prefix_caching"),
    ({"kv_offloading_size": -1.0, "enable_prefix_caching": True}, "kv_offloading_size"),
    ({"kv_cache_dir_size": 1.0, "enable_prefix_caching": True}, "kv_cache_dir_size needs kv_cache_dir"),
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": True, "tensor_parallel_size": 2}, "tensor_parallel"),
])
def test_bad_tier_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw)


def test_a_host_tier_too_small_for_one_block_is_refused(loaded_model):
    with pytest.raises(ValueError, match="holds no block"):
        make(loaded_model, 12, kv_offloading_size=1e-9)


def test_tier_counters_reach_metrics_and_generate_statistics(loaded_model, tmp_path, capsys):
    from pagedkv.cli import print_stats
    from pagedkv.server.metrics import ServerMetrics
    from prometheus_client.parser import text_string_to_metric_families

    llm = make(loaded_model, 12, kv_offloading_size=40 * block_bytes(loaded_model) / 2**30, kv_cache_dir=str(tmp_path))
    try:
        outs = [llm.generate([{"prompt_token_ids": p + [9, 9]}], params(), use_tqdm=False)[0]
                for p in conversations() + conversations()]
        s = llm.get_stats()
        metrics = ServerMetrics("m", 128)
        metrics.record_stats(s)
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        by_source = {x.labels["source"]: x.value for x in families["vllm:prompt_tokens_cached_by_source"].samples}
        assert by_source == {"device": s.prefix_cache_hits, "host": s.tier_hits_host, "disk": s.tier_hits_disk}
        assert by_source["host"] == 4 * PREFIX
        (hits,) = families["vllm:external_prefix_cache_hits"].samples
        assert hits.value == s.tier_hits_host + s.tier_hits_disk
        (offload,) = families["pagedkv:kv_offload_blocks"].samples
        assert offload.value == s.kv_offloaded_blocks > 0
        print_stats(llm, outs, 1.0)
        assert f"{s.tier_hits_host} prompt tokens from host memory" in capsys.readouterr().out
    finally:
        llm.shutdown()
