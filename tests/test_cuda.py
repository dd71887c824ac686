"""CUDA kernels vs the pure-PyTorch reference and vs the CPU kernels.

Every case builds a fresh random paged cache with a shuffled block table, so
blocks of a sequence are not contiguous. Tolerances (absolute, on outputs of
magnitude ~1): fp32 1e-4, fp16 5e-3, bf16 3e-2: the kernels accumulate in fp32
and round once on output, the reference does the same in PyTorch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pagedkv
import pytest
import torch
from pagedkv import ops, reference
from pagedkv.kv_cache import allocate_layer_cache, kv_cache_format

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and pagedkv.built_with_cuda),
    reason="needs a CUDA device and pagedkv built with CUDA",
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [8, 16, 32]
ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DEVICE = "cuda"


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen):
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return key_cache, value_cache


def make_tables(seq_lens, block_size, gen, extra_blocks=3):
    """Shuffled, non-overlapping block tables; returns (block_tables, num_blocks)."""
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    max_blocks = max(per_seq)
    num_blocks = sum(per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for s, n in enumerate(per_seq):
        table[s, :n] = perm[start : start + n].int()
        start += n
    return table.to(DEVICE), num_blocks


def decode_case(
    seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0, alibi=False
):
    gen = _seeded(seed)
    block_tables, num_blocks = make_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_size, dtype, gen
    )
    query = (
        torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
        .to(dtype)
        .to(DEVICE)
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    slopes = None
    if alibi:
        slopes = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)],
            device=DEVICE,
        )
    return query, key_cache, value_cache, block_tables, lens, slopes


def run_v1(query, key_cache, value_cache, block_tables, lens, slopes, scale, out=None):
    out = torch.empty_like(query) if out is None else out
    ops.paged_attention_v1(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        lens,
        scale,
        int(lens.max()) if lens.numel() else 0,
        slopes,
    )
    return out


def run_v2(
    query,
    key_cache,
    value_cache,
    block_tables,
    lens,
    slopes,
    scale,
    partition_size,
    extra_partitions=0,
):
    max_len = int(lens.max()) if lens.numel() else 0
    parts = (max_len + partition_size - 1) // partition_size + extra_partitions
    n, h, d = query.shape
    # Scratch filled with garbage: unused partitions must not leak into the output.
    exp_sums = torch.full((n, h, parts), float("nan"), device=DEVICE)
    max_logits = torch.full((n, h, parts), float("nan"), device=DEVICE)
    tmp_out = torch.full((n, h, parts, d), float("nan"), device=DEVICE).to(query.dtype)
    out = torch.empty_like(query)
    ops.paged_attention_v2(
        out,
        exp_sums,
        max_logits,
        tmp_out,
        query,
        key_cache,
        value_cache,
        block_tables,
        lens,
        scale,
        max_len,
        slopes,
        partition_size,
    )
    return out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), atol=ATOL[dtype], rtol=ATOL[dtype]
    )


def call_cpu(fn):
    """Runs a CPU kernel for comparison. A missing CPU kernel is a failure, not a skip:
    every op has one, and a skip would hide its absence on exactly the machines that run this file."""
    try:
        return fn()
    except RuntimeError as e:
        if "not built" in str(e) or "Could not run" in str(e):  # ours / the dispatcher's wording
            pytest.fail(f"CPU kernel missing: {e}")
        raise


# ---- decode ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_v1_all_shapes_match_reference(dtype, head_size, block_size):
    # GQA ratio varies with the case so every instantiation meets several ratios overall.
    num_kv_heads, group = [(2, 1), (1, 3), (2, 4), (1, 8)][
        (head_size // 16 + block_size) % 4
    ]
    seq_lens = [1, 17, 97, block_size, 3 * block_size + 1, 300]
    args = decode_case(
        seq_lens,
        num_kv_heads * group,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        seed=head_size + block_size,
    )
    scale = head_size**-0.5
    out = run_v1(*args, scale)
    expected = reference.paged_attention(*args[:5], scale, args[5])
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (6, 2), (8, 2), (16, 2), (12, 1), (24, 2), (64, 1), (5, 1), (7, 1), (10, 2), (14, 2)],
)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_gqa_ratios(num_heads, num_kv_heads, version):
    dtype = torch.float16
    args = decode_case(
        [5, 64, 700, 1300], num_heads, num_kv_heads, 128, 16, dtype, seed=num_heads
    )
    scale = 128**-0.5
    out = (
        run_v1(*args, scale)
        if version == "v1"
        else run_v2(*args, scale, partition_size=256)
    )
    expected = reference.paged_attention(*args[:5], scale, args[5])
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [256, 512, 1024])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_v2_multi_partition_matches_reference_and_v1(dtype, partition_size, head_size):
    # Lengths on both sides of partition boundaries, one empty sequence, one much shorter
    # than the longest (its trailing partitions must be skipped and ignored).
    seq_lens = [
        0,
        1,
        partition_size,
        partition_size + 1,
        2 * partition_size - 1,
        3000,
        37,
    ]
    args = decode_case(
        seq_lens, 8, 2, head_size, 16, dtype, seed=partition_size + head_size
    )
    scale = head_size**-0.5
    out = run_v2(*args, scale, partition_size, extra_partitions=2)
    expected = reference.paged_attention(*args[:5], scale, args[5])
    assert_close(out, expected, dtype)
    assert_close(out, run_v1(*args, scale), dtype)
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi(version, dtype):
    args = decode_case([3, 250, 1100], 8, 2, 64, 16, dtype, seed=7, alibi=True)
    scale = 0.125
    out = (
        run_v1(*args, scale)
        if version == "v1"
        else run_v2(*args, scale, partition_size=256)
    )
    expected = reference.paged_attention(*args[:5], scale, args[5])
    assert_close(out, expected, dtype)


def test_seq_len_zero_gives_zeros():
    args = decode_case([0, 0, 5], 4, 4, 64, 16, torch.float32, seed=3)
    out = run_v1(*args, 0.125, out=torch.full_like(args[0], 7.0))
    assert torch.all(out[:2] == 0)
    assert torch.all(run_v2(*args, 0.125, partition_size=256)[:2] == 0)


def test_strided_query_and_out():
    dtype = torch.float16
    query, key_cache, value_cache, block_tables, lens, _ = decode_case(
        [9, 130, 513], 8, 2, 96, 8, dtype, seed=11
    )
    big_q = torch.randn(3, 3 * 8 * 96, device=DEVICE).to(dtype)
    q = big_q[:, 8 * 96 : 2 * 8 * 96].view(
        3, 8, 96
    )  # a slice of a fused QKV projection
    q.copy_(query)
    big_out = torch.zeros(3, 2 * 8 * 96, device=DEVICE, dtype=dtype)
    out = big_out[:, 8 * 96 :].view(3, 8, 96)
    assert q.stride(0) != 8 * 96 and out.stride(0) != 8 * 96
    run_v1(q, key_cache, value_cache, block_tables, lens, None, 0.1, out=out)
    expected = reference.paged_attention(
        query, key_cache, value_cache, block_tables, lens, 0.1
    )
    assert_close(out, expected, dtype)
    assert torch.all(big_out[:, : 8 * 96] == 0)  # nothing written outside the view


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_op_picks_a_path(dtype):
    # Few sequences with long contexts: the allocating op takes v2 on CUDA.
    for seq_lens in ([4000, 17], [5, 9, 33, 1] * 40):
        args = decode_case(seq_lens, 8, 8, 128, 16, dtype, seed=len(seq_lens))
        out = ops.paged_attention(*args[:5], 0.09, alibi_slopes=args[5])
        assert_close(out, reference.paged_attention(*args[:5], 0.09, args[5]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_decode_matches_cpu_kernels(dtype, version):
    args = decode_case(
        [1, 40, 333, 1024, 1500], 12, 4, 80, 16, dtype, seed=5, alibi=True
    )
    scale = 80**-0.5
    cpu = [a.cpu() if a is not None else None for a in args]
    if version == "v1":
        out = run_v1(*args, scale)
        cpu_out = torch.empty_like(cpu[0])
        call_cpu(
            lambda: torch.ops.pagedkv.paged_attention_v1(
                cpu_out, *cpu[:5], scale, 1500, cpu[5]
            )
        )
    else:
        out = run_v2(*args, scale, 512)
        n, h, d = cpu[0].shape
        es, ml = torch.empty(n, h, 3), torch.empty(n, h, 3)
        tmp = torch.empty(n, h, 3, d, dtype=dtype)
        cpu_out = torch.empty_like(cpu[0])
        call_cpu(
            lambda: torch.ops.pagedkv.paged_attention_v2(
                cpu_out, es, ml, tmp, *cpu[:5], scale, 1500, cpu[5], 512
            )
        )
    assert_close(out, cpu_out, dtype)


# ---- prefill -----------------------------------------------------------------------


def prefill_case(
    q_lens, ctx_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0
):
    gen = _seeded(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    block_tables, num_blocks = make_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_size, dtype, gen
    )
    query = (
        torch.randn(sum(q_lens), num_heads, head_size, generator=gen)
        .to(dtype)
        .to(DEVICE)
    )
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query, key_cache, value_cache, block_tables, qsl, lens


def run_prefill(
    query, key_cache, value_cache, block_tables, qsl, lens, scale, out=None
):
    out = torch.empty_like(query) if out is None else out
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    ops.paged_prefill_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        qsl,
        lens,
        scale,
        max(q_lens, default=0),
        int(lens.max()) if lens.numel() else 0,
    )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_prefill_matches_reference(dtype, head_size):
    # Plain prefill, chunked prefill over a cached prefix, a single token, an empty sequence.
    block_size = [8, 16, 32][head_size % 3]
    args = prefill_case(
        [37, 70, 1, 0, 130],
        [0, 45, 200, 9, 64],
        8,
        2,
        head_size,
        block_size,
        dtype,
        seed=head_size,
    )
    scale = head_size**-0.5
    out = run_prefill(*args, scale)
    assert_close(out, reference.paged_prefill_attention(*args, scale), dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(3, 3), (6, 2), (8, 2), (16, 2), (24, 1), (64, 1), (96, 1)],
)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_gqa_ratios(num_heads, num_kv_heads, block_size):
    dtype = torch.bfloat16
    args = prefill_case(
        [65, 3, 33],
        [0, 100, 31],
        num_heads,
        num_kv_heads,
        64,
        block_size,
        dtype,
        seed=num_heads,
    )
    out = run_prefill(*args, 0.125)
    assert_close(out, reference.paged_prefill_attention(*args, 0.125), dtype)


def test_prefill_single_token_equals_decode():
    dtype = torch.float32
    query, key_cache, value_cache, block_tables, lens, _ = decode_case(
        [1, 50, 400], 8, 4, 128, 16, dtype, seed=9
    )
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    out = run_prefill(query, key_cache, value_cache, block_tables, qsl, lens, 0.1)
    assert_close(
        out, run_v1(query, key_cache, value_cache, block_tables, lens, None, 0.1), dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_cpu_kernel(dtype):
    args = prefill_case([20, 64, 7], [10, 0, 90], 12, 4, 112, 16, dtype, seed=2)
    out = run_prefill(*args, 0.1)
    cpu = [a.cpu() for a in args]
    cpu_out = torch.empty_like(cpu[0])
    call_cpu(
        lambda: torch.ops.pagedkv.paged_prefill_attention(cpu_out, *cpu, 0.1, 64, 97)
    )
    assert_close(out, cpu_out, dtype)


# ---- cache ops ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 256])
@pytest.mark.parametrize("strided", [False, True])
def test_reshape_and_cache(dtype, head_size, strided):
    gen = _seeded(head_size)
    num_tokens, num_kv_heads, block_size, num_blocks = 45, 3, 16, 10
    if strided:  # key/value as slices of a fused [tokens, 3 * heads * d] projection
        fused = (
            torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen)
            .to(dtype)
            .to(DEVICE)
        )
        key, value = fused[:, 1], fused[:, 2]
    else:
        key = (
            torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
            .to(dtype)
            .to(DEVICE)
        )
        value = (
            torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
            .to(dtype)
            .to(DEVICE)
        )
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)
    key_cache, value_cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_size, dtype, gen
    )
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_reshape_and_cache_unaligned_rows_take_the_scalar_path():
    # A head stride that is not a multiple of 16 bytes (fp32, stride 65 elements).
    gen = _seeded(1)
    raw = torch.randn(9, 2, 65, generator=gen).to(DEVICE)
    key = raw[:, :, :64]
    value = raw[:, :, 1:]
    key_cache, value_cache = make_cache(4, 8, 2, 64, torch.float32, gen)
    slot_mapping = torch.tensor([0, 3, 31, -1, 8, 9, 10, 20, 17], device=DEVICE)
    ek, ev = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ek, ev, slot_mapping)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, ek) and torch.equal(value_cache, ev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mapping_device", ["cpu", DEVICE])
def test_copy_blocks_all_layers(dtype, mapping_device):
    gen = _seeded(4)
    layers = [make_cache(12, 16, 2, 128, dtype, gen) for _ in range(3)]
    key_caches = [k for k, _ in layers]
    value_caches = [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [1, 6], [2, 11], [7, 3]], dtype=torch.int64)
    ek = [k.clone() for k in key_caches]
    ev = [v.clone() for v in value_caches]
    reference.copy_blocks(ek, ev, mapping)
    ops.copy_blocks(key_caches, value_caches, mapping.to(mapping_device))
    for a, b in zip(key_caches + value_caches, ek + ev, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["gpu_to_cpu", "cpu_to_gpu", "gpu_to_gpu"])
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks(direction, pinned):
    gen = _seeded(5)
    shape = (10, 16, 2, 64)
    src = torch.randn(shape, generator=gen).half()
    dst = torch.randn(shape, generator=gen).half()
    src_dev, dst_dev = {
        "gpu_to_cpu": (DEVICE, "cpu"),
        "cpu_to_gpu": ("cpu", DEVICE),
        "gpu_to_gpu": (DEVICE, DEVICE),
    }[direction]
    src, dst = src.to(src_dev), dst.to(dst_dev)
    if pinned:
        src = src.pin_memory() if src.is_cpu else src
        dst = dst.pin_memory() if dst.is_cpu else dst
    # Consecutive runs (0,1,2 -> 4,5,6) are coalesced into one copy; the rest are single blocks.
    mapping = torch.tensor([[0, 4], [1, 5], [2, 6], [9, 0], [3, 9]], dtype=torch.int64)
    expected = dst.cpu().clone()
    reference.swap_blocks(src.cpu(), expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), expected)


def test_swap_blocks_within_one_gpu_tensor_is_sequential():
    # src is dst: the run 0,1,2 -> 1,2,3 must not become one overlapping copy.
    cache = torch.randn((6, 16, 2, 64), generator=_seeded(6)).half().to(DEVICE)
    mapping = torch.tensor([[0, 1], [1, 2], [2, 3], [5, 4]], dtype=torch.int64)
    expected = cache.cpu().clone()
    reference.swap_blocks(expected, expected, mapping)
    ops.swap_blocks(cache, cache, mapping)
    torch.cuda.synchronize()
    assert torch.equal(cache.cpu(), expected)


# ---- bad input ---------------------------------------------------------------------


def test_device_mismatch_is_an_error():
    query, key_cache, value_cache, block_tables, lens, _ = decode_case(
        [5], 4, 4, 64, 16, torch.float16
    )
    with pytest.raises(RuntimeError, match="device"):
        run_v1(
            query.cpu(),
            key_cache,
            value_cache,
            block_tables,
            lens,
            None,
            0.1,
            out=torch.empty_like(query.cpu()),
        )
    with pytest.raises(RuntimeError, match="device"):
        run_v1(query, key_cache, value_cache, block_tables.cpu(), lens, None, 0.1)


def test_out_of_range_block_id_is_an_error():
    query, key_cache, value_cache, block_tables, lens, _ = decode_case(
        [40], 4, 4, 64, 16, torch.float16
    )
    bad = block_tables.clone()
    bad[0, 1] = key_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_v1(query, key_cache, value_cache, bad, lens, None, 0.1)
    bad[0, 1] = -1
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_v2(query, key_cache, value_cache, bad, lens, None, 0.1, partition_size=256)


def test_bad_slot_mapping_and_block_mapping_are_errors():
    key_cache, value_cache = make_cache(4, 8, 2, 64, torch.float16, _seeded(0))
    key = torch.zeros(3, 2, 64, device=DEVICE, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="slot"):
        ops.reshape_and_cache(
            key, key, key_cache, value_cache, torch.tensor([0, 1, 32], device=DEVICE)
        )
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ops.reshape_and_cache(
            key, key, key_cache, value_cache, torch.tensor([0, 1, 2])
        )  # CPU slots
    with pytest.raises(RuntimeError, match="block_mapping"):
        ops.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 4]]))
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.swap_blocks(
            key_cache, value_cache.cpu(), torch.tensor([[0, 1]], device=DEVICE)
        )


def test_bad_block_id_is_masked_when_host_checks_are_skipped():
    # PAGEDKV_SKIP_INDEX_CHECKS=1 drops the host-side table check (read once per process,
    # hence the subprocess): the kernels must then skip the bad block, not read outside
    # the cache. The sequence's other tokens still give a finite, normalized result.
    script = textwrap.dedent(
        """
        import torch, pagedkv
        from pagedkv import ops
        torch.manual_seed(0)
        kc = torch.randn(6, 16, 2, 64, device="cuda")
        vc = torch.ones(6, 16, 2, 64, device="cuda")
        q = torch.randn(2, 4, 64, device="cuda")
        bt = torch.tensor([[0, 1 << 30, 2], [3, -7, 4]], dtype=torch.int32, device="cuda")
        lens = torch.tensor([40, 20], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        ops.paged_attention_v1(out, q, kc, vc, bt, lens, 0.1, 40)
        es = torch.empty(2, 4, 1, device="cuda"); ml = torch.empty_like(es)
        tmp = torch.empty(2, 4, 1, 64, device="cuda"); out2 = torch.empty_like(q)
        ops.paged_attention_v2(out2, es, ml, tmp, q, kc, vc, bt, lens, 0.1, 40, None, 256)
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
        out3 = torch.empty_like(q)
        ops.paged_prefill_attention(out3, q, kc, vc, bt, qsl, lens, 0.1, 1, 40)
        torch.cuda.synchronize()
        for o in (out, out2, out3):
            # V is all ones, so any softmax-weighted mix of readable tokens is exactly 1.
            assert torch.allclose(o, torch.ones_like(o)), o
        print("masked ok")
        """
    )
    env = dict(os.environ, PAGEDKV_SKIP_INDEX_CHECKS="1")
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "masked ok" in result.stdout, result.stderr[
        -2000:
    ]


# ---- sync-free ops, CUDA graphs, streams, large caches ----------------------------


@pytest.fixture
def checks_off():
    """The index-value checks off for one test (they sync; the engine validates on the host)."""
    previous = ops.set_index_checks(False)
    yield
    ops.set_index_checks(previous)


class DecodeStep:
    """Static buffers of one engine step: decode tokens (reshape_and_cache, v1, v2) and a
    prefill batch, all with explicit max lengths, so the step can be captured in a graph."""

    def __init__(self, dtype=torch.float16, num_heads=8, num_kv_heads=2, head_size=128, block_size=16):
        self.dtype, self.block_size, self.head_size = dtype, block_size, head_size
        self.num_decodes, self.max_blocks = 5, 40  # up to 640 tokens: 3 partitions of 256
        self.max_seq_len = self.max_blocks * block_size
        self.partition_size = 256
        self.prefill_q_lens, self.max_query_len = [7, 30], 32
        self.num_blocks = (self.num_decodes + len(self.prefill_q_lens)) * self.max_blocks + 8
        self.scale = head_size**-0.5
        shape = (self.num_blocks, block_size, num_kv_heads, head_size)
        self.key_cache = torch.randn(shape, device=DEVICE).to(dtype)
        self.value_cache = torch.randn(shape, device=DEVICE).to(dtype)
        n, t = self.num_decodes, sum(self.prefill_q_lens)
        self.query = torch.empty(n, num_heads, head_size, dtype=dtype, device=DEVICE)
        self.new_key = torch.empty(n, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
        self.new_value = torch.empty_like(self.new_key)
        self.slot_mapping = torch.empty(n, dtype=torch.int64, device=DEVICE)
        self.block_tables = torch.empty(n, self.max_blocks, dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.empty(n, dtype=torch.int32, device=DEVICE)
        self.out_v1, self.out_v2 = torch.empty_like(self.query), torch.empty_like(self.query)
        parts = self.max_seq_len // self.partition_size + 1
        self.exp_sums = torch.empty(n, num_heads, parts, device=DEVICE)
        self.max_logits = torch.empty_like(self.exp_sums)
        self.tmp_out = torch.empty(n, num_heads, parts, head_size, dtype=dtype, device=DEVICE)
        p = len(self.prefill_q_lens)
        self.prefill_query = torch.empty(t, num_heads, head_size, dtype=dtype, device=DEVICE)
        self.prefill_out = torch.empty_like(self.prefill_query)
        self.prefill_tables = torch.empty(p, self.max_blocks, dtype=torch.int32, device=DEVICE)
        self.prefill_lens = torch.empty(p, dtype=torch.int32, device=DEVICE)
        qsl = [0, *torch.tensor(self.prefill_q_lens).cumsum(0).tolist()]
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)

    def run(self):
        ops.reshape_and_cache(self.new_key, self.new_value, self.key_cache, self.value_cache, self.slot_mapping)
        common = (self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.scale, self.max_seq_len)
        ops.paged_attention_v1(self.out_v1, self.query, *common)
        ops.paged_attention_v2(self.out_v2, self.exp_sums, self.max_logits, self.tmp_out, self.query, *common, None,
                               self.partition_size)
        ops.paged_prefill_attention(self.prefill_out, self.prefill_query, self.key_cache, self.value_cache,
                                    self.prefill_tables, self.query_start_loc, self.prefill_lens, self.scale,
                                    self.max_query_len, self.max_seq_len)

    def new_inputs(self, seed):
        """Writes fresh values into the static buffers (shapes fixed, contents new)."""
        gen = _seeded(seed)
        perm = torch.randperm(self.num_blocks, generator=gen)[: (self.num_decodes + 2) * self.max_blocks]
        tables = perm.view(-1, self.max_blocks).int()
        lens = torch.randint(1, self.max_seq_len + 1, (self.num_decodes,), generator=gen, dtype=torch.int32)
        lens[0] = self.max_seq_len  # one sequence at the bound
        last = (lens - 1).long()
        slots = tables[: self.num_decodes].long().gather(1, (last // self.block_size)[:, None])[:, 0]
        slots = slots * self.block_size + last % self.block_size
        for buf, value in (
            (self.block_tables, tables[: self.num_decodes]),
            (self.prefill_tables, tables[self.num_decodes :]),
            (self.seq_lens, lens),
            (self.slot_mapping, slots),
            (self.prefill_lens, torch.tensor([q + 50 * i for i, q in enumerate(self.prefill_q_lens)],
                                             dtype=torch.int32)),
        ):
            buf.copy_(value)
        for buf in (self.query, self.new_key, self.new_value, self.prefill_query):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(self.dtype))

    def check(self):
        kc, vc = self.key_cache, self.value_cache
        flat_k = kc.view(-1, *kc.shape[2:])
        assert torch.equal(flat_k[self.slot_mapping], self.new_key), "reshape_and_cache wrote the wrong slots"
        expected = reference.paged_attention(self.query, kc, vc, self.block_tables, self.seq_lens, self.scale)
        assert_close(self.out_v1, expected, self.dtype)
        assert_close(self.out_v2, expected, self.dtype)
        expected = reference.paged_prefill_attention(self.prefill_query, kc, vc, self.prefill_tables,
                                                     self.query_start_loc, self.prefill_lens, self.scale)
        assert_close(self.prefill_out, expected, self.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_step_captured_in_a_cuda_graph(dtype, checks_off):
    """reshape_and_cache + v1 + v2 + prefill, captured once, replayed on new inputs written
    into the static buffers: every replay matches the reference."""
    step = DecodeStep(dtype)
    step.new_inputs(seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (one-time attribute setup, allocator)
        step.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    for seed in (1, 2, 3):
        step.new_inputs(seed)
        graph.replay()
        torch.cuda.synchronize()
        step.check()


def test_ops_with_checks_off_never_sync(checks_off):
    """With explicit max lengths and the checks off, no op makes a synchronizing CUDA call."""
    step = DecodeStep()
    step.new_inputs(seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step.run()
        ops.paged_attention(step.query, step.key_cache, step.value_cache, step.block_tables, step.seq_lens,
                            step.scale, max_seq_len=step.max_seq_len)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    step.check()


def test_checks_on_or_missing_max_seq_len_do_sync():
    """The documented syncs: the index checks, and paged_attention without max_seq_len."""
    step = DecodeStep()
    step.new_inputs(seed=0)
    torch.cuda.synchronize()
    for checks, max_seq_len in ((True, step.max_seq_len), (False, None)):
        with ops.index_checks(checks):
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    ops.paged_attention(step.query, step.key_cache, step.value_cache, step.block_tables,
                                        step.seq_lens, step.scale, max_seq_len=max_seq_len)
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_ops_on_a_non_default_stream():
    """Every op enqueues on the current stream: run on a side stream behind a long busy
    kernel, read back only after that stream is synchronized."""
    step = DecodeStep(torch.bfloat16)
    step.new_inputs(seed=4)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the ops queue behind this on `side`, not on the default stream
        step.run()
    side.synchronize()
    step.check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_v2_attends_past_max_seq_len_when_checks_are_off(dtype, checks_off):
    """seq_lens above the max_seq_len the scratch and grid were sized for: the last launched
    partition takes the tail, so the result is still the full attention (no dropped tokens)."""
    args = decode_case([700, 1300, 90, 0], 4, 2, 64, 16, dtype, seed=11)
    query, key_cache, value_cache, block_tables, lens, _ = args
    n, h, d = query.shape
    max_seq_len, partition_size = 500, 256
    parts = 2
    exp_sums = torch.empty(n, h, parts, device=DEVICE)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(n, h, parts, d, dtype=dtype, device=DEVICE)
    out = torch.empty_like(query)
    scale = d**-0.5
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables, lens,
                           scale, max_seq_len, None, partition_size)
    assert_close(out, reference.paged_attention(query, key_cache, value_cache, block_tables, lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_covers_more_tokens_than_max_query_len(dtype, checks_off):
    """A q_len above max_query_len (checks off): both prefill kernels stride over query
    tiles, so every row is still written."""
    args = prefill_case([200, 3], [10, 40], 8, 2, 128, 16, dtype, seed=12)
    query, key_cache, value_cache, block_tables, qsl, lens = args
    out = torch.full_like(query, float("nan"))
    scale = 128**-0.5
    ops.paged_prefill_attention(out, query, key_cache, value_cache, block_tables, qsl, lens, scale, 64,
                                int(lens.max()))
    expected = reference.paged_prefill_attention(query, key_cache, value_cache, block_tables, qsl, lens, scale)
    assert_close(out, expected, dtype)


def test_cache_over_2_31_elements():
    """int64 offsets everywhere: a cache of more than 2^31 elements (4.3 GB per cache in bf16),
    sequences in its last blocks, a slot past 2^31 elements."""
    dtype, block_size, num_kv_heads, head_size = torch.bfloat16, 16, 8, 128
    per_block = block_size * num_kv_heads * head_size
    num_blocks = (1 << 31) // per_block + 64
    assert num_blocks * per_block > (1 << 31)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    value_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    gen = _seeded(13)
    # Two sequences: one in the highest blocks, one mixing the first and the last blocks.
    tables = torch.tensor([[num_blocks - 1 - i for i in range(8)],
                           [0, num_blocks - 20, 1, num_blocks - 30, 2, 3, 4, 5]], dtype=torch.int32)
    used = tables.flatten().long().to(DEVICE)
    key_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype).to(DEVICE)
    value_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype).to(DEVICE)
    tables = tables.to(DEVICE)
    lens = torch.tensor([128, 100], dtype=torch.int32, device=DEVICE)
    # Write the last token of sequence 0 (slot in block num_blocks - 8) through reshape_and_cache.
    new_k = torch.randn(1, num_kv_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    slot = torch.tensor([(num_blocks - 8) * block_size + 15], device=DEVICE)
    ops.reshape_and_cache(new_k, new_k, key_cache, value_cache, slot)
    assert torch.equal(key_cache[num_blocks - 8, 15], new_k[0])
    query = torch.randn(2, 32, head_size, generator=gen).to(dtype).to(DEVICE)
    scale = head_size**-0.5
    expected = reference.paged_attention(query, key_cache, value_cache, tables, lens, scale)
    assert_close(run_v1(query, key_cache, value_cache, tables, lens, None, scale), expected, dtype)
    assert_close(run_v2(query, key_cache, value_cache, tables, lens, None, scale, 256), expected, dtype)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    pq = torch.randn(5, 32, head_size, generator=gen).to(dtype).to(DEVICE)
    expected = reference.paged_prefill_attention(pq, key_cache, value_cache, tables, qsl, lens, scale)
    assert_close(run_prefill(pq, key_cache, value_cache, tables, qsl, lens, scale), expected, dtype)
    del key_cache, value_cache
    torch.cuda.empty_cache()


def test_v1_or_v2_rule_reads_the_sm_count():
    """paged_attention picks v2 below 4 (sequence, kv head) CTAs per SM of *this* device."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def chosen(num_seqs):
        query, key_cache, value_cache, block_tables, lens, _ = decode_case(
            [2048] * num_seqs, 2, 1, 64, 16, torch.float16, seed=num_seqs
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ops.paged_attention(query, key_cache, value_cache, block_tables, lens, 0.125, max_seq_len=2048)
        names = {event.name for event in prof.events()}
        return "v2" if "pagedkv::paged_attention_v2" in names else "v1"

    assert chosen(4 * sms - 1) == "v2"
    assert chosen(4 * sms) == "v1"


# ---- sliding window and logit soft-capping --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (13, 2.5), (16, 0.0), (300, 0.0), (0, 3.0), (5000, 1.0)])
def test_window_and_soft_cap_match_reference(window, soft_cap, head_size, dtype):
    """Decode v1, v2 (windows across partitions) and prefill (chunks after context) with the window/cap kernels."""
    q, kc, vc, bt, lens, slopes = decode_case([0, 1, 37, 300, 1100], 12, 2, head_size, 16, dtype, seed=window,
                                              alibi=True)
    scale = head_size**-0.5
    expected = reference.paged_attention(q, kc, vc, bt, lens, scale, slopes, window, soft_cap)
    out = torch.empty_like(q)
    ops.paged_attention_v1(out, q, kc, vc, bt, lens, scale, 1100, slopes, sliding_window=window,
                           logits_soft_cap=soft_cap)
    assert_close(out, expected, dtype)
    for partition_size in (256, 512):
        parts = math.ceil(1100 / partition_size) + 1
        es = torch.full((5, 12, parts), float("nan"), device=DEVICE)
        tmp = torch.full((5, 12, parts, head_size), float("nan"), device=DEVICE).to(dtype)
        out = torch.empty_like(q)
        ops.paged_attention_v2(out, es, es.clone(), tmp, q, kc, vc, bt, lens, scale, 1100, slopes, partition_size,
                               sliding_window=window, logits_soft_cap=soft_cap)
        assert_close(out, expected, dtype)
    args = prefill_case([37, 70, 1, 0, 130], [0, 45, 200, 9, 270], 8, 2, head_size, 16, dtype, seed=window)
    out = torch.empty_like(args[0])
    ops.paged_prefill_attention(out, *args, scale, 130, 400, sliding_window=window, logits_soft_cap=soft_cap)
    assert_close(out, reference.paged_prefill_attention(*args, scale, window, soft_cap), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_never_reads_freed_blocks(dtype):
    """Blocks wholly before the window hold NaN and -1 / out-of-range table entries, index checks on."""
    q, kc, vc, bt, lens, _ = decode_case([300, 77, 1100], 8, 2, 64, 16, dtype, seed=11)
    window, scale = 50, 0.125
    expected = reference.paged_attention(q, kc, vc, bt, lens, scale, None, window, 2.0)
    bt = bt.clone()
    for s, n in enumerate([300, 77, 1100]):
        for b in range(max(0, n - window) // 16):
            kc[int(bt[s, b])] = float("nan")
            vc[int(bt[s, b])] = float("nan")
            bt[s, b] = -1 if b % 2 else 1 << 20
    with ops.index_checks(True):
        out = ops.paged_attention(q, kc, vc, bt, lens, scale, max_seq_len=1100, sliding_window=window,
                                  logits_soft_cap=2.0)
        assert torch.isfinite(out).all()
        assert_close(out, expected, dtype)
        parts = math.ceil(1100 / 256)
        es = torch.empty(3, 8, parts, device=DEVICE)
        tmp = torch.full((3, 8, parts, 64), float("nan"), device=DEVICE).to(dtype)
        out = torch.empty_like(q)
        ops.paged_attention_v2(out, es, es.clone(), tmp, q, kc, vc, bt, lens, scale, 1100, None, 256,
                               sliding_window=window, logits_soft_cap=2.0)
        assert torch.isfinite(out).all()
        assert_close(out, expected, dtype)


# ---- quantized KV caches (kv_cache_dtype) ------------------------------------------
# The CUDA writers must store reference.quantize_kv's codes and (scale, zero) planes bit
# for bit; the attention kernels read them as reference.dequantize_kv does (the tensor-core
# prefill rounds the dequantized K/V to the query dtype, within the dtype's tolerance).

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head"]


def quant_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen, fp8_scales=(0.05, 0.5)):
    """A CUDA KVCache in fmt holding the codes of random K/V (fp8: per-tensor scales fp8_scales)."""
    f = kv_cache_format(fmt)
    cache = allocate_layer_cache(f, num_blocks, block_size, num_kv_heads, head_size, dtype,
                                 lambda shape, dt: torch.zeros(shape, dtype=dt, device=DEVICE))
    if f.is_fp8:
        cache.k_scale.fill_(fp8_scales[0])
        cache.v_scale.fill_(fp8_scales[1])
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    for codes, scale in ((cache.key, cache.k_scale), (cache.value, cache.v_scale)):
        x = torch.randn(shape, generator=gen) * 2
        q, plane = reference.quantize_kv(x, fmt, scale.cpu() if f.is_fp8 else None)
        codes.copy_(q.to(DEVICE))
        if plane is not None:
            scale.copy_(plane.to(DEVICE))
    return cache


def cpu_args(cache):
    """The cache's op_args with its tensors on the CPU (for the reference)."""
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in cache.op_args.items()}


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,strided", [(64, False), (80, True), (112, False), (256, True)])
def test_reshape_and_cache_quantized_is_bit_exact(fmt, dtype, head_size, strided):
    gen = _seeded(head_size + QUANTIZED.index(fmt))
    num_tokens, num_kv_heads, block_size, num_blocks = 37, 3, 16, 6
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen) * 3
    fused[0] = 0.75  # constant rows: scale 0
    fused[1] *= 5000.0  # saturates e4m3 after the scale
    fused = fused.to(dtype).to(DEVICE)
    key, value = (fused[:, 1], fused[:, 2]) if strided else (fused[:, 1].clone(), fused[:, 2].clone())
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    cache = quant_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen, fp8_scales=(0.37, 2.5))
    expected = [t.cpu().clone() for t in cache.block_tensors()]
    args = cpu_args(cache)
    if cache.format.per_token_scale:
        args["k_scale"], args["v_scale"] = expected[2], expected[3]
    reference.reshape_and_cache(key.cpu(), value.cpu(), expected[0], expected[1], slots, **args)
    ops.reshape_and_cache(key, value, cache.key, cache.value, slots.to(DEVICE), **cache.op_args)
    for actual, want in zip(cache.block_tensors(), expected, strict=True):
        assert torch.equal(actual.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_and_cache_quantizes_the_rotated_key(fmt, dtype):
    gen = _seeded(7 + QUANTIZED.index(fmt))
    num_tokens, nh, nkv, head_size, block_size, num_blocks, max_pos = 19, 6, 2, 64, 16, 4, 128
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    qkv = torch.randn(num_tokens, nh + 2 * nkv, head_size, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    cache = quant_cache(fmt, num_blocks, block_size, nkv, head_size, dtype, gen)
    expected = [t.cpu().clone() for t in cache.block_tensors()]
    ek = reference.rotary_embedding(positions.cpu(), k.cpu(), cos_sin.cpu())
    ops.rotary_embedding_and_cache(positions, q, k, v, cache.key, cache.value, slots.to(DEVICE), cos_sin, True,
                                   **cache.op_args)
    assert_close(k, ek, dtype)
    # The codes are those of the key as the kernel rotated it (rounding of the rotation aside).
    args = cpu_args(cache)
    if cache.format.per_token_scale:
        args["k_scale"], args["v_scale"] = expected[2], expected[3]
    reference.reshape_and_cache(k.cpu(), v.cpu(), expected[0], expected[1], slots, **args)
    for actual, want in zip(cache.block_tensors(), expected, strict=True):
        assert torch.equal(actual.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1), (12, 1)])
def test_decode_quantized_matches_reference(fmt, dtype, head_size, num_heads, num_kv_heads):
    gen = _seeded(head_size + num_heads)
    seq_lens = [1, 37, 300, 0, 700]
    block_size = 16
    block_tables, num_blocks = make_tables(seq_lens, block_size, gen)
    cache = quant_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_size**-0.5
    expected = reference.paged_attention(query.cpu(), cache.key.cpu(), cache.value.cpu(), block_tables.cpu(),
                                         lens.cpu(), scale, **cpu_args(cache))
    out = torch.empty_like(query)
    ops.paged_attention_v1(out, query, cache.key, cache.value, block_tables, lens, scale, max(seq_lens),
                           **cache.op_args)
    assert_close(out, expected, dtype)
    parts = (max(seq_lens) + 255) // 256
    n, h, d = query.shape
    exp_sums = torch.empty(n, h, parts, device=DEVICE)
    max_logits = torch.empty(n, h, parts, device=DEVICE)
    tmp_out = torch.empty(n, h, parts, d, device=DEVICE, dtype=dtype)
    out2 = torch.empty_like(query)
    ops.paged_attention_v2(out2, exp_sums, max_logits, tmp_out, query, cache.key, cache.value, block_tables, lens,
                           scale, max(seq_lens), None, 256, **cache.op_args)
    assert_close(out2, expected, dtype)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_decode_quantized_with_window_soft_cap_and_alibi(fmt):
    gen = _seeded(3)
    dtype, head_size, num_heads, num_kv_heads, block_size = torch.bfloat16, 128, 8, 2, 16
    seq_lens = [5, 600, 1100]
    block_tables, num_blocks = make_tables(seq_lens, block_size, gen)
    cache = quant_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(num_heads)], device=DEVICE)
    expected = reference.paged_attention(query.cpu(), cache.key.cpu(), cache.value.cpu(), block_tables.cpu(),
                                         lens.cpu(), 0.1, slopes.cpu(), 300, 4.0, **cpu_args(cache))
    out = torch.empty_like(query)
    ops.paged_attention_v1(out, query, cache.key, cache.value, block_tables, lens, 0.1, max(seq_lens), slopes,
                           300, 4.0, **cache.op_args)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 9, 3), (80, 4, 4), (128, 8, 1), (256, 6, 2)])
def test_prefill_quantized_matches_reference(fmt, dtype, head_size, num_heads, num_kv_heads):
    gen = _seeded(head_size + num_heads)
    q_lens, ctx_lens, block_size = [37, 70, 1, 0], [0, 45, 100, 9], 16
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    block_tables, num_blocks = make_tables(seq_lens, block_size, gen)
    cache = quant_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_size**-0.5
    for window, cap in ((0, 0.0), (40, 2.0)):
        expected = reference.paged_prefill_attention(query.cpu(), cache.key.cpu(), cache.value.cpu(),
                                                     block_tables.cpu(), qsl.cpu(), lens.cpu(), scale, window, cap,
                                                     **cpu_args(cache))
        out = torch.empty_like(query)
        ops.paged_prefill_attention(out, query, cache.key, cache.value, block_tables, qsl, lens, scale,
                                    max(q_lens), max(seq_lens), window, cap, **cache.op_args)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_copy_blocks_quantized_moves_codes_and_planes(fmt):
    gen = _seeded(4)
    layers = [quant_cache(fmt, 9, 8, 1, 80, torch.float16, gen) for _ in range(2)]
    mapping = torch.tensor([[0, 5], [1, 6], [8, 2]], dtype=torch.int64)
    expected = [[t.cpu().clone() for t in c.block_tensors()] for c in layers]
    planes = layers[0].format.per_token_scale
    reference.copy_blocks([e[0] for e in expected], [e[1] for e in expected], mapping,
                          [e[2] for e in expected] if planes else None, [e[3] for e in expected] if planes else None)
    ops.copy_blocks([c.key for c in layers], [c.value for c in layers], mapping,
                    [c.k_scale for c in layers] if planes else None, [c.v_scale for c in layers] if planes else None)
    for c, want in zip(layers, expected, strict=True):
        for a, b in zip(c.block_tensors(), want, strict=True):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_swap_blocks_moves_quantized_block_tensors(fmt):
    gen = _seeded(5)
    gpu = quant_cache(fmt, 6, 16, 2, 64, torch.bfloat16, gen)
    mapping = torch.tensor([[0, 2], [1, 3], [5, 0]], dtype=torch.int64)
    for t in gpu.block_tensors():
        host = torch.zeros_like(t, device="cpu").pin_memory()
        expected = host.clone()
        reference.swap_blocks(t.cpu(), expected, mapping)
        ops.swap_blocks(t, host, mapping)
        torch.cuda.synchronize()
        assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8_per_token_head"])
def test_quantized_step_is_graph_capturable_and_reads_scales_on_device(checks_off, fmt):
    """Write + decode captured in a CUDA graph: no host sync; fp8 scales changed after capture apply at replay."""
    gen = _seeded(8)
    dtype, nh, nkv, d, bs = torch.float16, 8, 2, 128, 16
    seq_lens = [40, 17]
    block_tables, num_blocks = make_tables(seq_lens, bs, gen)
    cache = quant_cache(fmt, num_blocks, bs, nkv, d, dtype, gen)
    key = torch.randn(2, nkv, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(2, nkv, d, generator=gen).to(dtype).to(DEVICE)
    query = torch.randn(2, nh, d, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    slots = torch.stack([block_tables[s, (n - 1) // bs].long() * bs + (n - 1) % bs
                         for s, n in enumerate(seq_lens)])
    out = torch.empty_like(query)

    def step():
        ops.reshape_and_cache(key, value, cache.key, cache.value, slots, **cache.op_args)
        ops.paged_attention_v1(out, query, cache.key, cache.value, block_tables, lens, 0.1, 64, **cache.op_args)

    step()  # warm-up (lazy initialization outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    if cache.format.is_fp8:
        cache.k_scale.fill_(0.11)
        cache.v_scale.fill_(0.7)
    graph.replay()
    torch.cuda.synchronize()
    expected_cache = [t.cpu() for t in cache.block_tensors()]
    expected = reference.paged_attention(query.cpu(), expected_cache[0], expected_cache[1], block_tables.cpu(),
                                         lens.cpu(), 0.1, **cpu_args(cache))
    assert_close(out, expected, dtype)
