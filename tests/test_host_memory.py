"""KV cache memory on the host: huge-page backed tensors (pagedkv.host_memory)."""

import mmap
import os
import subprocess
import sys

import pytest
import torch
from pagedkv import host_memory, ops, reference
from pagedkv.config import ModelConfig
from pagedkv.engine.model_runner import allocate_kv_cache

needs_thp = pytest.mark.skipif(not host_memory.huge_pages_available(), reason="no transparent huge pages here")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_huge_pages_is_aligned_advised_and_usable(dtype):
    shape = (397, 16, 3, 64)  # an odd block count: 2.3 or 4.7 MiB, not a multiple of 2 MiB
    t = host_memory.empty_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert host_memory.advised_huge(t)
    values = torch.randn(shape).to(dtype)
    t.copy_(values)
    assert torch.equal(t, values)


def test_small_tensors_and_the_off_switch_give_plain_tensors(monkeypatch):
    # Asked through the madvise hook rather than read back from /proc/self/smaps: malloc may hand a small
    # tensor memory inside a heap stretch an earlier test advised, so the mapping's flag says nothing here.
    advised = []
    monkeypatch.setattr(host_memory, "_madvise_huge", lambda address, length: advised.append(length) or True)
    small = host_memory.empty_huge_pages((4, 16, 2, 64), torch.float32)  # 32 KiB
    assert small.shape == (4, 16, 2, 64) and small.untyped_storage().nbytes() == small.nbytes
    assert advised == []
    monkeypatch.setenv("PAGEDKV_CPU_HUGE_PAGES", "0")
    host_memory.huge_pages_available.cache_clear()
    try:
        big = host_memory.empty_huge_pages((64, 16, 8, 128), torch.float32)  # 4 MiB
        assert big.shape == (64, 16, 8, 128) and big.untyped_storage().nbytes() == big.nbytes
        assert advised == []
    finally:
        monkeypatch.undo()
        host_memory.huge_pages_available.cache_clear()


@needs_thp
def test_engine_kv_cache_uses_huge_pages_and_decodes_correctly():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    caches = allocate_kv_cache(cfg, num_kv_heads=2, num_blocks=300, block_size=16, dtype=torch.float32,
                               device=torch.device("cpu"))
    key_cache, value_cache = caches[0]
    assert host_memory.advised_huge(key_cache) and host_memory.advised_huge(value_cache)
    gen = torch.Generator().manual_seed(0)
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
    query = torch.randn(3, 4, cfg.head_dim, generator=gen)
    tables = torch.randperm(300, generator=gen)[:3 * 20].view(3, 20).to(torch.int32)
    seq_lens = torch.tensor([1, 170, 320], dtype=torch.int32)
    scale = cfg.head_dim ** -0.5
    out = ops.paged_attention(query, key_cache, value_cache, tables, seq_lens, scale=scale)
    expected = reference.paged_attention(query, key_cache, value_cache, tables, seq_lens, scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


_FAULTS_SCRIPT = """
import resource, torch
from pagedkv import host_memory
took = host_memory.keep_freed_activations()
def step():  # a step's activations (96 MiB in 12 buffers), written, then freed at its end
    live = [torch.ones((8 << 20) // 4 + 1024 * i) for i in range(12)]
    return sum(t[0] for t in live)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(took, faults * 4096 / (96 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_keeps_freed_activations_for_the_next_step():
    """Tuned, a step's freed activations are reused by the next without faulting their pages in again;
    untuned (the off switch), glibc hands them back and every step faults them in anew."""
    def fault_ratio(switch: str) -> tuple[str, float]:
        # Both start from glibc's default thresholds held fixed (128 KiB): left sliding, as by default, they
        # follow what the process happened to free before, and the untuned case would vary from run to run.
        env = dict(os.environ, PAGEDKV_CPU_MALLOC_TUNING=switch,
                   GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072")
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], float(out[1])

    took, tuned = fault_ratio("1")
    if took != "True":
        pytest.skip("not glibc: no mallopt")
    off, untuned = fault_ratio("0")
    assert off == "False"
    assert tuned < 1, f"tuned: {tuned:.1f} steps' activations worth of page faults in 20 steps"
    assert untuned > 10, f"untuned: {untuned:.1f} steps' activations worth of page faults in 20 steps"


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's pages that are present (mincore)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
def test_background_prefault_backs_pages_and_leaves_contents_alone():
    # Fresh anonymous mappings: unbacked zero pages whatever malloc did before in this process.
    size = 40 << 20
    maps = [mmap.mmap(-1, size) for _ in range(3)]
    tensors = [torch.frombuffer(m, dtype=torch.float32) for m in maps]
    tensors[1][: 1 << 20].fill_(7.0)  # written before: kept
    before = _resident_bytes(tensors[2])
    job = host_memory.BackgroundPrefault(tensors, chunk_bytes=1 << 20)
    tensors[0][-(1 << 20):].fill_(3.0)  # written while it runs: kept
    assert job.wait(120)
    if job.bytes_done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert job.bytes_done == job.total_bytes == 3 * size
    assert before < size and _resident_bytes(tensors[2]) == size
    assert torch.all(tensors[1][: 1 << 20] == 7.0) and torch.all(tensors[1][1 << 20:] == 0.0)
    assert torch.all(tensors[0][-(1 << 20):] == 3.0) and torch.all(tensors[0][:-(1 << 20)] == 0.0)


def test_background_prefault_stops_when_the_cache_is_freed_or_stopped():
    tensors = [torch.empty(16 << 20, dtype=torch.uint8) for _ in range(2)]
    job = host_memory.BackgroundPrefault(tensors, chunk_bytes=4096)
    job.stop()
    assert job.wait(30) and job.bytes_done < job.total_bytes
    tensors = [torch.empty(64 << 20, dtype=torch.uint8)]
    job = host_memory.BackgroundPrefault(tensors, chunk_bytes=4096)
    del tensors
    assert job.wait(60) and job.bytes_done < 64 << 20


def test_engine_with_background_prefault_generates_the_same_tokens(monkeypatch, loaded_model):
    from pagedkv import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 37 * i, 140 + 41 * i))} for i in range(4)]
    outputs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("PAGEDKV_CPU_KV_PREFAULT", switch)
        llm = LLM(loaded_model=loaded_model, kv_cache_memory=256 << 20, max_model_len=512)
        job = llm.llm_engine.runner.kv_prefault
        assert (job is None) == (switch == "0")
        outputs[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if job is not None:
            assert job.wait(120) and job.bytes_done in (0, job.total_bytes)
        del llm
    assert outputs["0"] == outputs["1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise")
def test_background_prefault_waits_for_the_engine_to_idle():
    clock = host_memory.IdleClock()
    tensors = [host_memory.empty_huge_pages((40 << 20,), torch.uint8)]
    with clock.busy():  # a step running: nothing is backed
        job = host_memory.BackgroundPrefault(tensors, chunk_bytes=1 << 20, idle=clock)
        assert not job.wait(0.3)
        assert job.bytes_done == 0
    assert job.wait(120)  # idle from here: all of it, or none where the kernel lacks the call
    assert job.bytes_done in (0, 40 << 20)
