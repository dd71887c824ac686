"""torch.library.opcheck on every pagedkv op, and the ops inside torch.compile (CPU).

opcheck runs each op through its schema (mutations and aliasing as declared),
the autograd registration check, the fake kernel against the real one, and
AOT dispatch with dynamic shapes. Every sub-test applies to every op here, so
none is switched off. (`pagedkv::cpu_capability` and `set_cpu_capability` are left
out: they take and return no tensor, so there is nothing for opcheck to trace.) Attention outputs
are compared with pagedkv.reference at the tolerance stated next to each dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedkv import ops, reference

BLOCK_SIZE = 16
# Attention accumulates in float32 in both the kernels and the reference; what
# differs is the rounding of inputs/outputs to the storage dtype.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _decode_inputs(num_seqs=3, seq_lens=(5, 33, 17), num_heads=4, num_kv_heads=2, head_size=64, num_blocks=12,
                   dtype=torch.float32, seed=0):
    """(query, key_cache, value_cache, block_tables, seq_lens, scale) with non-contiguous block ids."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = list(seq_lens)[:num_seqs]
    max_blocks = max(1, math.ceil(max(seq_lens) / BLOCK_SIZE))
    query = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(dtype)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    block_tables = torch.stack(
        [torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(num_seqs)]
    ).to(torch.int32)
    return (query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            1.0 / math.sqrt(head_size))


# ---- opcheck --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seq_len", [None, 40])
def test_opcheck_paged_attention(max_seq_len):
    q, kc, vc, bt, lens, scale = _decode_inputs()
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, (q, kc, vc, bt, lens, scale, max_seq_len))


def test_opcheck_paged_attention_with_alibi():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, (q, kc, vc, bt, lens, scale, 33, slopes))


def test_opcheck_paged_attention_v1():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_v1.default, (out, q, kc, vc, bt, lens, scale, 33, None))


def test_opcheck_paged_attention_v2():
    q, kc, vc, bt, lens, scale = _decode_inputs(seq_lens=(300, 120, 513), num_blocks=80)
    partition_size, max_seq_len = 256, 513
    num_partitions = math.ceil(max_seq_len / partition_size)
    num_seqs, num_heads, head_size = q.shape
    exp_sums = torch.empty(num_seqs, num_heads, num_partitions)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(num_seqs, num_heads, num_partitions, head_size)
    out = torch.empty_like(q)
    torch.library.opcheck(
        torch.ops.pagedkv.paged_attention_v2.default,
        (out, exp_sums, max_logits, tmp_out, q, kc, vc, bt, lens, scale, max_seq_len, None, partition_size),
    )


def test_opcheck_paged_prefill_attention():
    gen = torch.Generator().manual_seed(1)
    _, kc, vc, bt, lens, scale = _decode_inputs(seq_lens=(5, 33, 17))
    q_lens = [5, 2, 7]  # a full prefill, a chunk, a prefix hit
    query_start_loc = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 4, 64, generator=gen)
    out = torch.empty_like(query)
    torch.library.opcheck(
        torch.ops.pagedkv.paged_prefill_attention.default,
        (out, query, kc, vc, bt, query_start_loc, lens, scale, max(q_lens), 33),
    )


# Sliding window and soft cap: a window shorter than the sequences (blocks before it skipped)
# and a cap that bites, through every attention op's schema.
WINDOW, SOFT_CAP = 9, 2.0


def test_opcheck_paged_attention_with_window_and_soft_cap():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default,
                          (q, kc, vc, bt, lens, scale, 33, slopes, WINDOW, SOFT_CAP))
    got = torch.ops.pagedkv.paged_attention(q, kc, vc, bt, lens, scale, 33, slopes, WINDOW, SOFT_CAP)
    want = reference.paged_attention(q, kc, vc, bt, lens, scale, slopes, WINDOW, SOFT_CAP)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_opcheck_paged_attention_v1_with_window_and_soft_cap():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_v1.default,
                          (out, q, kc, vc, bt, lens, scale, 33, None, WINDOW, SOFT_CAP))


def test_opcheck_paged_attention_v2_with_window_and_soft_cap():
    q, kc, vc, bt, lens, scale = _decode_inputs(seq_lens=(300, 120, 513), num_blocks=80)
    partition_size, max_seq_len = 256, 513
    num_partitions = math.ceil(max_seq_len / partition_size)
    num_seqs, num_heads, head_size = q.shape
    exp_sums = torch.empty(num_seqs, num_heads, num_partitions)
    tmp_out = torch.zeros(num_seqs, num_heads, num_partitions, head_size)
    out = torch.empty_like(q)
    torch.library.opcheck(
        torch.ops.pagedkv.paged_attention_v2.default,
        (out, exp_sums, torch.empty_like(exp_sums), tmp_out, q, kc, vc, bt, lens, scale, max_seq_len, None,
         partition_size, 200, SOFT_CAP),
    )


def test_opcheck_paged_prefill_attention_with_window_and_soft_cap():
    gen = torch.Generator().manual_seed(1)
    _, kc, vc, bt, lens, scale = _decode_inputs(seq_lens=(5, 33, 17))
    query_start_loc = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    query = torch.randn(14, 4, 64, generator=gen)
    out = torch.empty_like(query)
    torch.library.opcheck(
        torch.ops.pagedkv.paged_prefill_attention.default,
        (out, query, kc, vc, bt, query_start_loc, lens, scale, 7, 33, WINDOW, SOFT_CAP),
    )


def test_opcheck_reshape_and_cache():
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(5, 2, 64, generator=gen)
    value = torch.randn(5, 2, 64, generator=gen)
    key_cache = torch.zeros(4, BLOCK_SIZE, 2, 64)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([3, 17, -1, 40, 63])
    torch.library.opcheck(torch.ops.pagedkv.reshape_and_cache.default, (key, value, key_cache, value_cache, slots))


def test_opcheck_copy_blocks():
    gen = torch.Generator().manual_seed(3)
    key_caches = [torch.randn(6, BLOCK_SIZE, 2, 64, generator=gen) for _ in range(2)]
    value_caches = [torch.randn(6, BLOCK_SIZE, 2, 64, generator=gen) for _ in range(2)]
    mapping = torch.tensor([[0, 3], [1, 4]])
    torch.library.opcheck(torch.ops.pagedkv.copy_blocks.default, (key_caches, value_caches, mapping))


def test_opcheck_swap_blocks():
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(6, BLOCK_SIZE, 2, 64, generator=gen)
    dst = torch.zeros(3, BLOCK_SIZE, 2, 64)
    torch.library.opcheck(torch.ops.pagedkv.swap_blocks.default, (src, dst, torch.tensor([[5, 0], [2, 2]])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_rms_norm(dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 7, generator=gen).to(dtype)
    weight = torch.rand(7, generator=gen).to(dtype)
    torch.library.opcheck(torch.ops.pagedkv.rms_norm.default, (torch.empty_like(x), x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_fused_add_rms_norm(dtype):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 576, generator=gen).to(dtype)
    residual = torch.randn(3, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    torch.library.opcheck(torch.ops.pagedkv.fused_add_rms_norm.default, (x, residual, weight, 1e-6))


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_act_and_mul(op, dtype):
    x = torch.randn(5, 2 * 37, generator=torch.Generator().manual_seed(12)).to(dtype)
    torch.library.opcheck(getattr(torch.ops.pagedkv, op).default, (torch.empty(5, 37, dtype=dtype), x))


@pytest.mark.parametrize("is_neox", [True, False])
def test_opcheck_rotary_embedding_and_cache(is_neox):
    gen = torch.Generator().manual_seed(10)
    query = torch.randn(5, 4, 64, generator=gen)
    key = torch.randn(5, 2, 64, generator=gen)
    value = torch.randn(5, 2, 64, generator=gen)
    key_cache = torch.zeros(4, BLOCK_SIZE, 2, 64)
    value_cache = torch.zeros_like(key_cache)
    cos_sin = torch.randn(100, 64, generator=gen)
    positions = torch.tensor([0, 7, 99, 3, 50])
    slots = torch.tensor([3, 17, -1, 40, 63])
    torch.library.opcheck(
        torch.ops.pagedkv.rotary_embedding_and_cache.default,
        (positions, query, key, value, key_cache, value_cache, slots, cos_sin, is_neox),
    )


def test_opcheck_fused_moe():
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts, top_k = 7, 32, 24, 8, 2
    weights, ids = reference.moe_routing(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    args = (torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_experts, 2 * inter, hidden, generator=gen),
            torch.randn(num_experts, hidden, inter, generator=gen), weights, ids)
    torch.library.opcheck(torch.ops.pagedkv.fused_moe.default, args)


# ---- torch.compile --------------------------------------------------------------------------------


def _decode_step(key, value, key_cache, value_cache, slot_mapping, query, block_tables, seq_lens, scale):
    """One decode step as a model runs it: write the new token's K/V, then attend."""
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    out = ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return out * 2.0  # some surrounding compute for the compiler to fuse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_inside_torch_compile(dtype):
    torch._dynamo.reset()
    q, kc, vc, bt, lens, scale = _decode_inputs(dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    num_seqs, _, head_size = q.shape
    new_key = torch.randn(num_seqs, kc.shape[2], head_size, generator=gen).to(dtype)
    new_value = torch.randn(num_seqs, kc.shape[2], head_size, generator=gen).to(dtype)
    # The new token of sequence s is its last position, seq_len - 1.
    last = lens.long() - 1
    slots = bt.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + last % BLOCK_SIZE

    compiled = torch.compile(_decode_step, fullgraph=True, backend="inductor")
    kc_compiled, vc_compiled = kc.clone(), vc.clone()
    got = compiled(new_key, new_value, kc_compiled, vc_compiled, slots, q, bt, lens, scale)

    kc_eager, vc_eager = kc.clone(), vc.clone()
    eager = _decode_step(new_key, new_value, kc_eager, vc_eager, slots, q, bt, lens, scale)
    reference.reshape_and_cache(new_key, new_value, kc, vc, slots)
    want = reference.paged_attention(q, kc, vc, bt, lens, scale) * 2.0

    # The compiled graph must have mutated the caches in place, exactly as eager did.
    assert torch.equal(kc_compiled, kc) and torch.equal(vc_compiled, vc)
    assert torch.equal(kc_eager, kc) and torch.equal(vc_eager, vc)
    torch.testing.assert_close(got, eager, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


def _write_then_fork(key, value, key_caches, value_caches, slot_mapping, block_mapping):
    """Write new tokens into layer 0, then copy-on-write blocks in every layer."""
    ops.reshape_and_cache(key * 0.5, value, key_caches[0], value_caches[0], slot_mapping)
    ops.copy_blocks(key_caches, value_caches, block_mapping)
    return key_caches[0].sum()


def test_cache_ops_inside_torch_compile():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(5, 2, 64, generator=gen)
    value = torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([0, 1, -1, 17, 35])
    mapping = torch.tensor([[0, 4], [1, 5]])
    caches = [torch.randn(6, BLOCK_SIZE, 2, 64, generator=gen) for _ in range(4)]

    compiled = torch.compile(_write_then_fork, fullgraph=True, backend="inductor")
    got_caches = [c.clone() for c in caches]
    got = compiled(key, value, got_caches[:2], got_caches[2:], slots, mapping)

    want_caches = [c.clone() for c in caches]
    reference.reshape_and_cache(key * 0.5, value, want_caches[0], want_caches[2], slots)
    reference.copy_blocks(want_caches[:2], want_caches[2:], mapping)
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g, w)
    torch.testing.assert_close(got, want_caches[0].sum())


def test_opcheck_sample_from_logits():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(5, 300, generator=gen)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.8])
    uniforms = torch.rand(5, generator=gen)
    torch.library.opcheck(torch.ops.pagedkv.sample_from_logits.default,
                          (torch.empty(5, dtype=torch.int64), logits, temps, uniforms))


def test_opcheck_apply_token_bitmask():
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(4, 100, generator=gen)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    torch.library.opcheck(torch.ops.pagedkv.apply_token_bitmask.default,
                          (logits, bitmask, torch.tensor([3, 1])))
