"""KV cache memory on the host: huge-page backed tensors (pagedkv.host_memory)."""

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
