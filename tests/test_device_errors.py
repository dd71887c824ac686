"""Inputs on the wrong device, meta tensors, and mixed dtypes: clear errors, never silent no-ops.

CPU cases run everywhere. Cases with a CUDA tensor need a GPU and a build
with CUDA (PAGEDKV_CUDA=1) and are skipped otherwise.
"""

from __future__ import annotations

import math

import pagedkv
import pytest
import torch
from pagedkv import ops

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and pagedkv.built_with_cuda), reason="needs a GPU and a CUDA build of pagedkv"
)


def _decode_inputs(device="cpu", dtype=torch.float32):
    """Two sequences (lengths 5 and 20), 2 query heads over 1 KV head, head size 64, block size 16."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 64, generator=gen).to(dtype)
    key_cache = torch.randn(4, 16, 1, 64, generator=gen).to(dtype)
    value_cache = torch.randn(4, 16, 1, 64, generator=gen).to(dtype)
    block_tables = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 20], dtype=torch.int32)
    tensors = [t.to(device) for t in (query, key_cache, value_cache, block_tables, seq_lens)]
    return (*tensors, 1.0 / math.sqrt(64))


def _write_inputs(device="cpu"):
    key = torch.randn(3, 1, 64)
    value = torch.randn(3, 1, 64)
    key_cache = torch.zeros(4, 16, 1, 64)
    value_cache = torch.zeros(4, 16, 1, 64)
    slots = torch.tensor([0, 17, -1])
    return [t.to(device) for t in (key, value, key_cache, value_cache, slots)]


# ---- meta tensors ---------------------------------------------------------------------------------


def test_all_meta_paged_attention_propagates_shapes():
    q, kc, vc, bt, lens, scale = _decode_inputs(device="meta")
    out = ops.paged_attention(q, kc, vc, bt, lens, scale, max_seq_len=20)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype


def test_all_meta_cache_ops_are_accepted():
    """Meta caches with the (CPU) index tensors the ops take: a shape-only dry run.

    Each op returns nothing and leaves every tensor where it was: the caches stay
    meta with their shape and dtype, the real index tensors keep their values.
    """
    key, value, key_cache, value_cache, _ = _write_inputs(device="meta")
    slots, pairs = torch.tensor([0, 17, -1]), torch.tensor([[0, 1]])
    assert ops.reshape_and_cache(key, value, key_cache, value_cache, slots) is None
    assert ops.copy_blocks([key_cache], [value_cache], pairs) is None
    assert ops.swap_blocks(key_cache, value_cache, pairs) is None
    for t in (key, value):
        assert t.device.type == "meta" and t.shape == (3, 1, 64) and t.dtype == torch.float32
    for t in (key_cache, value_cache):
        assert t.device.type == "meta" and t.shape == (4, 16, 1, 64) and t.dtype == torch.float32
    assert slots.tolist() == [0, 17, -1] and pairs.tolist() == [[0, 1]]


@pytest.mark.parametrize("meta_arg", range(5))
def test_reshape_and_cache_refuses_meta_mixed_with_real(meta_arg):
    args = _write_inputs()
    args[meta_arg] = args[meta_arg].to("meta")
    with pytest.raises(RuntimeError, match=r"reshape_and_cache: \w+ is on cpu but other arguments are on meta"):
        ops.reshape_and_cache(*args)


@pytest.mark.parametrize("meta_arg", range(3))
def test_paged_attention_refuses_meta_mixed_with_real(meta_arg):
    """Without the check, a meta cache would make the op return an uninitialized CPU tensor."""
    args = list(_decode_inputs())
    args[meta_arg] = args[meta_arg].to("meta")
    with pytest.raises(RuntimeError, match=r"paged_attention: \w+ is on cpu but other arguments are on meta"):
        ops.paged_attention(*args)


def test_copy_blocks_refuses_one_meta_layer():
    real = [torch.zeros(4, 16, 1, 64) for _ in range(3)]
    meta = torch.zeros(4, 16, 1, 64, device="meta")
    with pytest.raises(RuntimeError, match=r"copy_blocks: key_caches\[0\] is on cpu but other arguments are on meta"):
        ops.copy_blocks([real[0], meta], [real[1], real[2]], torch.tensor([[0, 1]]))


def test_swap_blocks_refuses_meta_destination():
    with pytest.raises(RuntimeError, match=r"swap_blocks: src is on cpu but other arguments are on meta"):
        ops.swap_blocks(torch.zeros(4, 16), torch.zeros(4, 16, device="meta"), torch.tensor([[0, 1]]))


# ---- mixed dtypes (CPU) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index,dtype,message",
    [
        (0, torch.bfloat16, r"query dtype BFloat16 differs from key_cache dtype Float"),
        (2, torch.float16, r"value_cache dtype Half differs from key_cache dtype Float"),
        (3, torch.int64, r"block_tables must be Int, got Long"),
        (4, torch.int64, r"seq_lens must be Int, got Long"),
    ],
)
def test_paged_attention_rejects_mixed_dtypes(index, dtype, message):
    args = list(_decode_inputs())
    args[index] = args[index].to(dtype)
    with pytest.raises(RuntimeError, match=r"paged_attention\w*: " + message):
        ops.paged_attention(*args, max_seq_len=20)


def test_paged_attention_rejects_alibi_slopes_dtype():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    slopes = torch.ones(2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"alibi_slopes must be float32, got Half"):
        ops.paged_attention(q, kc, vc, bt, lens, scale, 20, slopes)


def test_paged_attention_v1_rejects_out_dtype():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    out = torch.empty(q.shape, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"paged_attention_v1: out dtype Half differs from query dtype Float"):
        ops.paged_attention_v1(out, q, kc, vc, bt, lens, scale, 20)


# ---- device mismatch (CUDA) -----------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("cpu_arg,name", [(0, "query"), (2, "value_cache"), (3, "block_tables"), (4, "seq_lens")])
def test_paged_attention_rejects_cpu_tensor_with_cuda_cache(cpu_arg, name):
    args = list(_decode_inputs(device="cuda"))
    args[cpu_arg] = args[cpu_arg].cpu()
    with pytest.raises(RuntimeError, match=rf"paged_attention\w*: {name} is on cpu but key_cache is on cuda"):
        ops.paged_attention(*args, max_seq_len=20)


@needs_cuda
@pytest.mark.parametrize("cpu_arg,name", [(0, "key"), (1, "value")])
def test_reshape_and_cache_rejects_cpu_key_value_with_cuda_cache(cpu_arg, name):
    args = _write_inputs(device="cuda")
    args[cpu_arg] = args[cpu_arg].cpu()
    with pytest.raises(RuntimeError, match=rf"reshape_and_cache: {name} is on cpu but the cache is on cuda"):
        ops.reshape_and_cache(*args)


@needs_cuda
def test_copy_blocks_rejects_layers_on_different_devices():
    cuda_k, cuda_v = torch.zeros(4, 16, 1, 64, device="cuda"), torch.zeros(4, 16, 1, 64, device="cuda")
    cpu_k, cpu_v = torch.zeros(4, 16, 1, 64), torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match=r"copy_blocks: .*(cpu|device)"):
        ops.copy_blocks([cuda_k, cpu_k], [cuda_v, cpu_v], torch.tensor([[0, 1]], device="cuda"))


@needs_cuda
def test_swap_blocks_cpu_cuda_round_trip():
    """swap_blocks is the one op meant to cross devices: CPU->GPU->CPU returns the same bytes."""
    src = torch.randn(6, 16, 1, 64)
    on_gpu = torch.zeros(3, 16, 1, 64, device="cuda")
    back = torch.zeros(6, 16, 1, 64)
    ops.swap_blocks(src, on_gpu, torch.tensor([[5, 0], [2, 1]]))
    ops.swap_blocks(on_gpu, back, torch.tensor([[0, 5], [1, 2]]))
    torch.cuda.synchronize()
    assert torch.equal(back[5], src[5]) and torch.equal(back[2], src[2])
    assert not back[[0, 1, 3, 4]].any()
