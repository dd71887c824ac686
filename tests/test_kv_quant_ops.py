"""The ops on quantized KV caches (kv_cache_dtype fp8 / int8 / int4), CPU, against pagedkv.reference.

Writes (reshape_and_cache, rotary_embedding_and_cache) must produce the reference's
codes and (scale, zero) planes bit for bit; the attention ops read them as the
reference dequantizes them (fresh random inputs, odd sizes, every CPU kernel variant
this machine runs); block copies move codes and planes; bad input is refused with a
message naming the argument.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib

import pytest
import torch
from pagedkv import ops, reference
from pagedkv.kv_cache import KVCache, allocate_layer_cache, kv_cache_format

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}




AMX_RUNS = ops.cpu_amx_runs()
BF16_RUNS = "avx512_bf16" in ops.runnable_cpu_capabilities()
# Every runnable variant; on a CPU with AMX also "amx": avx512_bf16 with bf16 prefill on AMX tiles (the
# others run with the tiles off, so both bf16 prefill paths are checked); with AVX512-BF16 also "bf16_fma":
# avx512_bf16 with cpu_bf16_dot() off (fp8 Q.K^T on fp32 FMAs, int8 P.V on paired codes at every head size;
# plain avx512_bf16 runs with it on), so both decode paths are checked whichever this CPU picks.
VARIANTS = [*ops.runnable_cpu_capabilities(), *(["amx"] if AMX_RUNS else []), *(["bf16_fma"] if BF16_RUNS else [])]


@pytest.fixture(params=VARIANTS)
def variant(request):
    if request.param == "amx" and "prefill" not in request.node.name:
        pytest.skip("AMX tiles change bf16 prefill only; the avx512_bf16 case runs this")
    if request.param == "bf16_fma" and "decode" not in request.node.name:
        pytest.skip("cpu_bf16_dot changes decode only; the avx512_bf16 case runs this")
    capability = "avx512_bf16" if request.param in ("amx", "bf16_fma") else request.param
    previous = ops.set_cpu_capability(capability)
    previous_amx = ops.set_cpu_amx(request.param == "amx") if AMX_RUNS else None
    previous_dot = ops.set_cpu_bf16_dot(request.param != "bf16_fma")
    yield capability
    ops.set_cpu_bf16_dot(previous_dot)
    if previous_amx is not None:
        ops.set_cpu_amx(previous_amx)
    ops.set_cpu_capability(previous)


def _zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def _gen(*case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _cache(fmt_name: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
           dtype: torch.dtype, gen: torch.Generator) -> KVCache:
    """A cache in fmt_name; fp8 gets random per-tensor scales (so scale handling is exercised)."""
    cache = allocate_layer_cache(kv_cache_format(fmt_name), num_blocks, block_size, num_kv_heads, head_size, dtype,
                                 _zeros)
    if cache.format.is_fp8:
        cache.k_scale.fill_(float(torch.rand((), generator=gen)) * 0.1 + 0.01)
        cache.v_scale.fill_(float(torch.rand((), generator=gen)) * 0.1 + 0.01)
    return cache


def _clone(cache: KVCache) -> KVCache:
    return KVCache(cache.key.clone(), cache.value.clone(), cache.kv_cache_dtype,
                   None if cache.k_scale is None else cache.k_scale.clone(),
                   None if cache.v_scale is None else cache.v_scale.clone())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _assert_same_cache(a: KVCache, b: KVCache) -> None:
    for x, y in zip(a.block_tensors(), b.block_tensors(), strict=True):
        assert torch.equal(_bytes(x), _bytes(y))


def _fill(cache: KVCache, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> None:
    """Writes random tokens into every slot of the cache (keys with a few large channels, like real ones)."""
    nb, bs, nkv = cache.key.shape[:3]
    d = cache.key.shape[3] * cache.format.values_per_element
    key = torch.randn(nb * bs, nkv, d, generator=gen) * scale
    key[..., :3] *= 8.0
    value = torch.randn(nb * bs, nkv, d, generator=gen) * scale
    ops.reshape_and_cache(key.to(dtype), value.to(dtype), cache.key, cache.value,
                          torch.arange(nb * bs, dtype=torch.int64), **cache.op_args)


# ---- quantize / dequantize (the reference rule) ----------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantized_error_is_within_the_format_step(fmt):
    x = torch.randn(64, 4, 128, generator=_gen(fmt)) * 3
    scale = torch.tensor([0.05])
    codes, plane = reference.quantize_kv(x, fmt, scale)
    back = reference.dequantize_kv(codes, fmt, scale if plane is None else plane)
    err = (back - x).abs()
    if kv_cache_format(fmt).is_fp8:
        mantissa = 3 if fmt == "fp8_e4m3" else 2
        # relative half-ulp of the format, plus its smallest subnormal step for tiny values
        assert torch.all(err <= x.abs() * 2.0 ** -(mantissa + 1) + 0.05 * 2.0 ** -9 * 1.01)
    else:
        if kv_cache_format(fmt).rotated:  # the bound holds where the codes live: on the rotated rows
            x = reference.hadamard_rows(x)
            err = (reference.hadamard_rows(back) - x).abs()
        step = plane[..., 0:1].float()  # a code step; rounding costs half, fp16 zero/scale a little more
        assert torch.all(err <= 0.5 * step + 2e-3 * x.abs().amax(-1, keepdim=True))


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([[1e6, -1e6, 448.0, 0.5]])
    for fmt, limit in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        codes, _ = reference.quantize_kv(x, fmt, torch.tensor([1.0]))
        assert torch.isfinite(codes.float()).all()
        assert codes.float()[0, 0] == limit and codes.float()[0, 1] == -limit


def test_per_token_head_constant_row_reads_back_exactly():
    x = torch.full((2, 3, 64), 0.75)
    codes, plane = reference.quantize_kv(x, "int8_per_token_head")
    assert torch.equal(reference.dequantize_kv(codes, "int8_per_token_head", plane), x)


def _hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
def test_hadamard_rows_is_the_block_diagonal_walsh_hadamard_rotation(head_size):
    x = torch.randn(7, 3, head_size, generator=_gen("hadamard", head_size), dtype=torch.float64).float()
    b = reference.rotation_block(head_size)
    assert b & (b - 1) == 0 and head_size % b == 0 and (head_size // b) % 2 == 1
    h = torch.block_diag(*[_hadamard_matrix(b)] * (head_size // b))
    y = reference.hadamard_rows(x)
    torch.testing.assert_close(y.double(), x.double() @ h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference.hadamard_rows(y), x, atol=1e-5, rtol=1e-5)  # its own inverse
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)  # orthonormal


def _int4_error_beside_outlier(x: torch.Tensor) -> torch.Tensor:
    """Norm of the int4 round trip's error on the channels after the outlier (channel 5)."""
    codes, plane = reference.quantize_kv(x, "int4_per_token_head")
    return (reference.dequantize_kv(codes, "int4_per_token_head", plane) - x)[..., 6:].norm()


def test_int4_rotation_keeps_the_channels_beside_an_outlier(monkeypatch):
    """A key row with one outlier channel (as real keys have after RoPE): unrotated, 16 levels over its range
    round every other channel to the same few codes; the rotated rule keeps them."""
    x = torch.randn(256, 2, 64, generator=_gen("outlier"))
    x[..., 5] = 40.0
    rotated_err = _int4_error_beside_outlier(x)
    monkeypatch.setattr(reference, "rotates_rows", lambda kv_cache_dtype: False)  # the same rule, unrotated
    plain_err = _int4_error_beside_outlier(x)
    assert rotated_err < 0.5 * plain_err, (rotated_err, plain_err)
    assert rotated_err < 0.45 * x[..., 6:].norm()


# ---- writers: bit-exact with the reference ---------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_kv_heads,block_size", [(64, 3, 16), (80, 1, 8), (256, 2, 32), (112, 5, 16)])
def test_reshape_and_cache_matches_reference_bit_for_bit(fmt, dtype, head_size, num_kv_heads, block_size):
    gen = _gen(fmt, dtype, head_size, num_kv_heads, block_size)
    num_blocks, num_tokens = 7, 45
    cache = _cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    expected = _clone(cache)
    # A strided source (a slice of a fused QKV output), padding slots, and large values that saturate fp8.
    qkv = torch.randn(num_tokens, num_kv_heads * 3, head_size, generator=gen).to(dtype) * 4
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    ops.reshape_and_cache(key, value, cache.key, cache.value, slots, **cache.op_args)
    reference.reshape_and_cache(key, value, expected.key, expected.value, slots, **expected.op_args)
    _assert_same_cache(cache, expected)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_and_cache_quantizes_the_rotated_key(fmt, dtype):
    gen = _gen("rope", fmt, dtype)
    num_tokens, heads, nkv, d, bs, nb = 13, 6, 2, 64, 16, 4
    cache = _cache(fmt, nb, bs, nkv, d, dtype, gen)
    expected = _clone(cache)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(128).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
    q = torch.randn(num_tokens, heads, d, generator=gen).to(dtype)
    k = torch.randn(num_tokens, nkv, d, generator=gen).to(dtype)
    v = torch.randn(num_tokens, nkv, d, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:num_tokens]
    q2, k2 = q.clone(), k.clone()
    ops.rotary_embedding_and_cache(positions, q, k, v, cache.key, cache.value, slots, cos_sin, True, **cache.op_args)
    reference.rotary_embedding_and_cache(positions, q2, k2, v, expected.key, expected.value, slots, cos_sin, True,
                                         **expected.op_args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(q, q2, atol=atol, rtol=rtol)
    # The kernel rotates in fp32 and rounds once like the reference; the codes then follow the rotated key.
    ops.reshape_and_cache(k, v, expected.key, expected.value, slots, **expected.op_args)
    _assert_same_cache(cache, expected)


# ---- attention reads the codes as the reference dequantizes them ----------------------------------


def _decode_case(fmt, dtype, head_size, num_heads, num_kv_heads, block_size, seq_lens, gen):
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    cache = _cache(fmt, num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    _fill(cache, dtype, gen)
    max_blocks = max(1, max(math.ceil(n / block_size) for n in seq_lens))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in seq_lens]).to(torch.int32)
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size",
                         [(64, 9, 3, 16), (128, 8, 8, 32), (80, 7, 1, 8), (256, 4, 2, 16), (96, 6, 2, 16)])
def test_decode_matches_reference(variant, fmt, dtype, head_size, num_heads, num_kv_heads, block_size):
    if variant == "avx512_bf16" and dtype != torch.bfloat16:
        pytest.skip("avx512_bf16 holds bf16 kernels only")
    gen = _gen("decode", fmt, dtype, head_size, num_heads, num_kv_heads, block_size)
    seq_lens = [1, 37, 200, 0, 513]
    cache, tables, lens = _decode_case(fmt, dtype, head_size, num_heads, num_kv_heads, block_size, seq_lens, gen)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_size)
    expected = reference.paged_attention(query, cache.key, cache.value, tables, lens, scale, **cache.op_args)
    out = ops.paged_attention(query, cache.key, cache.value, tables, lens, scale, max(seq_lens), **cache.op_args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    # v2 (partitions, then the reduce) reads the same values.
    parts = math.ceil(max(seq_lens) / 256)
    v2_out = torch.empty_like(query)
    exp_sums = torch.empty(len(seq_lens), num_heads, parts)
    ops.paged_attention_v2(v2_out, exp_sums, torch.empty_like(exp_sums),
                           torch.empty(len(seq_lens), num_heads, parts, head_size, dtype=dtype), query, cache.key,
                           cache.value, tables, lens, scale, max(seq_lens), None, 256, **cache.op_args)
    torch.testing.assert_close(v2_out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_of_rows_of_4_kib_and_more_matches_reference(variant, fmt, dtype):
    """32 kv heads of size 256: token rows of 4 KiB (int4) or 8 KiB (8-bit codes), which decode
    streams in groups of rows instead of sweeping whole blocks; the kv heads' slices of a row sit
    at head_size / 2 bytes apart in an int4 cache."""
    if variant == "avx512_bf16" and dtype != torch.bfloat16:
        pytest.skip("avx512_bf16 holds bf16 kernels only")
    gen = _gen("decode-wide", fmt, dtype)
    seq_lens = [5, 70, 130]
    cache, tables, lens = _decode_case(fmt, dtype, 256, 64, 32, 16, seq_lens, gen)
    query = torch.randn(len(seq_lens), 64, 256, generator=gen).to(dtype)
    expected = reference.paged_attention(query, cache.key, cache.value, tables, lens, 1 / 16, **cache.op_args)
    out = ops.paged_attention(query, cache.key, cache.value, tables, lens, 1 / 16, max(seq_lens), **cache.op_args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_decode_with_window_soft_cap_and_alibi_matches_reference(variant, fmt, dtype, head_size):
    if variant == "avx512_bf16" and dtype != torch.bfloat16:
        pytest.skip("avx512_bf16 holds bf16 kernels only")
    gen = _gen("decode-extras", fmt, dtype, head_size)
    # Windows of 40 and 41 start P.V on even and odd tokens inside a block (int8 pairs tokens
    # from head size 128 on, in the avx512_bf16 kernels).
    for window in (40, 41):
        cache, tables, lens = _decode_case(fmt, dtype, head_size, 6, 2, 16, [90, 17, 300], gen)
        query = torch.randn(3, 6, head_size, generator=gen).to(dtype)
        slopes = torch.rand(6, generator=gen) * 0.1
        extras = {"sliding_window": window, "logits_soft_cap": 5.0}
        expected = reference.paged_attention(query, cache.key, cache.value, tables, lens, 0.125, slopes, **extras,
                                             **cache.op_args)
        out = ops.paged_attention(query, cache.key, cache.value, tables, lens, 0.125, 300, slopes, **extras,
                                  **cache.op_args)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


# Codes whose exponent field is 0 (zero and the subnormals), per fp8 format: bit 7 is the sign.
_EXPONENT_ZERO_CODES = {"fp8_e4m3": [s | m for s in (0, 0x80) for m in range(8)],
                        "fp8_e5m2": [s | m for s in (0, 0x80) for m in range(4)]}
# The scale that puts those codes' values at about +-1 (largest subnormal: 7 * 2^-9, 3 * 2^-16).
_SUBNORMAL_SCALE = {"fp8_e4m3": 2.0 ** 7, "fp8_e5m2": 2.0 ** 14}


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("codes", ["exponent_zero", "all_finite"])
@pytest.mark.parametrize("d", [80, 128])
def test_decode_reads_every_fp8_code_as_its_value(variant, fmt, codes, d):
    """Zero, subnormal and normal codes written straight into the cache are read as the reference
    dequantizes them (the bf16 kernels widen fp8 to bf16 by moving bit fields at head size 80, which
    a subnormal or a zero code would get wrong without its own rule, and through byte tables at 128)."""
    gen = _gen("fp8-codes", fmt, codes, d)
    nb, bs, nkv, heads = 6, 16, 2, 8
    cache = _cache(fmt, nb, bs, nkv, d, torch.bfloat16, gen)
    if codes == "exponent_zero":
        pool = torch.tensor(_EXPONENT_ZERO_CODES[fmt], dtype=torch.uint8)
        cache.k_scale.fill_(_SUBNORMAL_SCALE[fmt])
    else:
        finite = [c for c in range(256) if math.isfinite(float(torch.tensor([c], dtype=torch.uint8).view(
            cache.key.dtype).float()))]
        pool = torch.tensor(finite, dtype=torch.uint8)
        cache.k_scale.fill_(2.0 / (448.0 if fmt == "fp8_e4m3" else 57344.0))
    for t in (cache.key, cache.value):
        picks = torch.randint(len(pool), t.shape, generator=gen)
        t.view(torch.uint8).copy_(pool[picks])
    cache.v_scale.fill_(cache.k_scale.item())
    tables = torch.randperm(nb, generator=gen)[:5].to(torch.int32)[None].repeat(2, 1)
    lens = torch.tensor([77, 33], dtype=torch.int32)
    query = torch.randn(2, heads, d, generator=gen).to(torch.bfloat16)
    expected = reference.paged_attention(query, cache.key, cache.value, tables, lens, 0.3, **cache.op_args)
    out = ops.paged_attention(query, cache.key, cache.value, tables, lens, 0.3, 77, **cache.op_args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_int8_decode_sums_the_largest_codes_at_head_size_256_without_overflow(variant):
    """Every K code 255 and a query of equal positive elements: Q.K^T's integer sums on the bf16
    kernels reach 256 x 32767 x 255 (just under 2^31); per-token scales then order the logits,
    so a sum that wrapped would reorder them and change the output."""
    gen = _gen("int8-extremes")
    nb, bs, nkv, d, heads = 3, 16, 1, 256, 2
    cache = _cache("int8_per_token_head", nb, bs, nkv, d, torch.bfloat16, gen)
    cache.key.fill_(255)
    k_plane = torch.stack([torch.rand(nb, bs, nkv, generator=gen) * 2e-3, torch.zeros(nb, bs, nkv)], dim=-1)
    cache.k_scale.copy_(k_plane.half())
    cache.value.copy_(torch.randint(256, cache.value.shape, generator=gen, dtype=torch.uint8))
    v_plane = torch.stack([torch.rand(nb, bs, nkv, generator=gen) * 0.02, torch.randn(nb, bs, nkv, generator=gen)],
                          dim=-1)
    cache.v_scale.copy_(v_plane.half())
    tables = torch.arange(nb, dtype=torch.int32)[None]
    lens = torch.tensor([nb * bs - 5], dtype=torch.int32)
    query = torch.full((1, heads, d), 0.75, dtype=torch.bfloat16)
    expected = reference.paged_attention(query, cache.key, cache.value, tables, lens, 1 / 16, **cache.op_args)
    out = ops.paged_attention(query, cache.key, cache.value, tables, lens, 1 / 16, nb * bs, **cache.op_args)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size", [(64, 9, 3, 16), (112, 4, 4, 8)])
def test_prefill_matches_reference(variant, fmt, dtype, head_size, num_heads, num_kv_heads, block_size):
    if variant == "avx512_bf16" and dtype != torch.bfloat16:
        pytest.skip("avx512_bf16 holds bf16 kernels only")
    gen = _gen("prefill", fmt, dtype, head_size, num_heads, num_kv_heads, block_size)
    seq_lens = [70, 5, 129]
    q_lens = [70, 2, 33]  # a whole prompt, a decode-sized chunk, a chunk after cached context
    cache, tables, lens = _decode_case(fmt, dtype, head_size, num_heads, num_kv_heads, block_size, seq_lens, gen)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_size)
    for extras in ({}, {"sliding_window": 31, "logits_soft_cap": 4.0}):
        expected = reference.paged_prefill_attention(query, cache.key, cache.value, tables, starts, lens, scale,
                                                     **extras, **cache.op_args)
        out = torch.empty_like(query)
        ops.paged_prefill_attention(out, query, cache.key, cache.value, tables, starts, lens, scale, max(q_lens),
                                    max(seq_lens), **extras, **cache.op_args)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8_per_token_head"])
def test_quantized_attention_stays_close_to_the_unquantized_cache(fmt):
    """The end-to-end sense of it: attention over a quantized cache is near attention over the original values."""
    gen = _gen("closeness", fmt)
    d, heads, nkv, bs, nb = 128, 8, 2, 16, 20
    key = torch.randn(nb * bs, nkv, d, generator=gen)
    value = torch.randn(nb * bs, nkv, d, generator=gen)
    plain = allocate_layer_cache(kv_cache_format("auto"), nb, bs, nkv, d, torch.float32, _zeros)
    quant = allocate_layer_cache(kv_cache_format(fmt), nb, bs, nkv, d, torch.float32, _zeros)
    if quant.format.is_fp8:
        quant.k_scale.fill_(float(key.abs().max()) / 200)
        quant.v_scale.fill_(float(value.abs().max()) / 100)
    slots = torch.arange(nb * bs)
    for c in (plain, quant):
        ops.reshape_and_cache(key, value, c.key, c.value, slots, **c.op_args)
    tables = torch.arange(nb, dtype=torch.int32)[None]
    lens = torch.tensor([nb * bs], dtype=torch.int32)
    q = torch.randn(1, heads, d, generator=gen)
    a = ops.paged_attention(q, plain.key, plain.value, tables, lens, d ** -0.5)
    b = ops.paged_attention(q, quant.key, quant.value, tables, lens, d ** -0.5, **quant.op_args)
    assert (a - b).norm() / a.norm() < 0.08


# ---- block copies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_copy_blocks_moves_codes_and_planes(fmt):
    gen = _gen("copy", fmt)
    layers = [_cache(fmt, 6, 16, 2, 64, torch.float32, gen) for _ in range(3)]
    for c in layers:
        _fill(c, torch.float32, gen)
    expected = [_clone(c) for c in layers]
    mapping = torch.tensor([[0, 3], [5, 1]])
    per_token = layers[0].format.per_token_scale
    scales = ({"key_scales": [c.k_scale for c in layers], "value_scales": [c.v_scale for c in layers]}
              if per_token else {})
    ops.copy_blocks([c.key for c in layers], [c.value for c in layers], mapping, **scales)
    ref_scales = ({"key_scales": [c.k_scale for c in expected], "value_scales": [c.v_scale for c in expected]}
                  if per_token else {})
    reference.copy_blocks([c.key for c in expected], [c.value for c in expected], mapping, **ref_scales)
    for c, e in zip(layers, expected, strict=True):
        _assert_same_cache(c, e)
        assert torch.equal(_bytes(c.key[3]), _bytes(c.key[0]))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_swap_blocks_moves_every_block_tensor(fmt):
    gen = _gen("swap", fmt)
    src = _cache(fmt, 6, 16, 2, 64, torch.bfloat16, gen)
    _fill(src, torch.bfloat16, gen)
    dst = _cache(fmt, 4, 16, 2, 64, torch.bfloat16, gen)
    mapping = torch.tensor([[5, 0], [2, 3]])
    for s, d in zip(src.block_tensors(), dst.block_tensors(), strict=True):
        ops.swap_blocks(s, d, mapping)
        assert torch.equal(_bytes(d[0]), _bytes(s[5])) and torch.equal(_bytes(d[3]), _bytes(s[2]))


# ---- bad input ------------------------------------------------------------------------------------


def _small(fmt="int8_per_token_head"):
    gen = _gen("small", fmt)
    cache = _cache(fmt, 4, 16, 2, 64, torch.float32, gen)
    key = torch.randn(3, 2, 64, generator=gen)
    return cache, key, torch.tensor([0, 5, 17])


BAD = {
    "unknown_format": (lambda c: {**c.op_args, "kv_cache_dtype": "fp4"}, r"kv_cache_dtype 'fp4' is not supported"),
    "plane_missing": (lambda c: {**c.op_args, "k_scale": None}, r"needs k_scale, the float16 \(scale, zero\) plane"),
    "plane_wrong_shape": (lambda c: {**c.op_args, "v_scale": torch.zeros(4, 16, 2, 1, dtype=torch.float16)},
                          r"v_scale must be \[num_blocks=4, block_size=16, num_kv_heads=2, 2\]"),
    "plane_wrong_dtype": (lambda c: {**c.op_args, "k_scale": c.k_scale.float()}, r"k_scale must be float16"),
    "wrong_storage": (lambda c: {**c.op_args, "kv_cache_dtype": "fp8_e5m2"},
                      r"kv_cache_dtype fp8_e5m2 stores Float8_e5m2 but key_cache is Byte"),
    "format_missing": (lambda c: {}, r"key_cache dtype Byte is not supported.*needs its kv_cache_dtype"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_cache_writer_refuses_bad_quantization_args(name):
    cache, key, slots = _small()
    make, pattern = BAD[name]
    before = [t.clone() for t in cache.block_tensors()]
    with pytest.raises(RuntimeError, match=pattern):
        ops.reshape_and_cache(key, key, cache.key, cache.value, slots, **make(cache))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.block_tensors(), strict=True))  # nothing written


@pytest.mark.parametrize("name", ["unknown_format", "plane_missing", "wrong_storage"])
def test_attention_refuses_bad_quantization_args(name):
    cache, _, _ = _small()
    make, pattern = BAD[name]
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match=pattern):
        ops.paged_attention(q, cache.key, cache.value, torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([3], dtype=torch.int32), 0.1, 3, **make(cache))


def test_scales_are_refused_on_an_unquantized_cache():
    cache = allocate_layer_cache(kv_cache_format("auto"), 2, 16, 1, 64, torch.float32, _zeros)
    with pytest.raises(RuntimeError, match=r"k_scale is given but kv_cache_dtype is auto"):
        ops.reshape_and_cache(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), cache.key, cache.value,
                              torch.tensor([0]), k_scale=torch.ones(1))


@pytest.mark.parametrize("writer", ["reshape_and_cache", "rotary_embedding_and_cache"])
def test_writers_refuse_key_and_value_of_different_dtypes(writer):
    """A quantized cache takes any compute dtype, but key and value must share one (both are read as key's)."""
    cache, key, slots = _small()
    value = key.to(torch.bfloat16)
    before = [t.clone() for t in cache.block_tensors()]
    with pytest.raises(RuntimeError, match=rf"{writer}: value dtype BFloat16 differs from key dtype Float"):
        if writer == "reshape_and_cache":
            ops.reshape_and_cache(key, value, cache.key, cache.value, slots, **cache.op_args)
        else:
            cos_sin = torch.zeros(8, 64)
            ops.rotary_embedding_and_cache(torch.zeros(3, dtype=torch.int64), torch.randn(3, 4, 64), key.clone(),
                                           value, cache.key, cache.value, slots, cos_sin, True, **cache.op_args)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.block_tensors(), strict=True))


def test_fp8_scale_must_be_one_float32():
    cache, key, slots = _small("fp8_e4m3")
    with pytest.raises(RuntimeError, match=r"k_scale of an fp8 cache must be a float32 tensor of one element"):
        ops.reshape_and_cache(key, key, cache.key, cache.value, slots, "fp8_e4m3", torch.ones(2), cache.v_scale)


def test_int4_head_size_is_twice_the_cache_last_dim():
    cache = allocate_layer_cache(kv_cache_format("int4_per_token_head"), 2, 16, 1, 64, torch.float32, _zeros)
    assert cache.key.shape[-1] == 32
    with pytest.raises(RuntimeError, match=r"head_size 64 \(twice the int4 cache's last dim\)|key must be"):
        ops.reshape_and_cache(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), cache.key, cache.value,
                              torch.tensor([0]), **cache.op_args)


# ---- opcheck: schemas (mutation of the planes declared), fake kernels ------------------------------


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4_per_token_head"])
def test_opcheck_quantized_ops(fmt):
    """Every opcheck sub-test on the uint8 (int4) caches. torch's schema check compares tensors with
    arithmetic float8 tensors lack on the CPU ("mul" not implemented), so fp8 caches run the others
    (the schema is the same one the int4 case checks)."""
    utils = (("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if kv_cache_format(fmt).is_fp8 else torch.library._OPCHECK_DEFAULT_UTILS)

    def opcheck(op, args):
        torch.library.opcheck(op, args, test_utils=utils)

    gen = _gen("opcheck", fmt)
    cache = _cache(fmt, 6, 16, 2, 64, torch.float32, gen)
    key = torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([0, 3, 17, 40, 95])
    opcheck(torch.ops.pagedkv.reshape_and_cache.default,
                          (key, key.clone(), cache.key, cache.value, slots, cache.kv_cache_dtype, cache.k_scale,
                           cache.v_scale))
    _fill(cache, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    opcheck(torch.ops.pagedkv.paged_attention.default,
                          (q, cache.key, cache.value, tables, lens, 0.125, 40, None, 0, 0.0, cache.kv_cache_dtype,
                           cache.k_scale, cache.v_scale))
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    opcheck(torch.ops.pagedkv.paged_prefill_attention.default,
                          (torch.empty_like(q), q, cache.key, cache.value, tables, starts, lens, 0.125, 1, 40, 0, 0.0,
                           cache.kv_cache_dtype, cache.k_scale, cache.v_scale))
    if cache.format.per_token_scale:
        opcheck(torch.ops.pagedkv.copy_blocks.default,
                              ([cache.key], [cache.value], torch.tensor([[0, 2]]), [cache.k_scale], [cache.v_scale]))


def test_cpu_bf16_dot_is_settable_and_the_environment_decides():
    """set_cpu_bf16_dot flips the choice and returns the previous one; PAGEDKV_CPU_BF16_DOT sets it at start
    (and a value other than 0 or 1 is refused, naming the variable)."""
    previous = ops.set_cpu_bf16_dot(False)
    try:
        assert not ops.cpu_bf16_dot()
        assert ops.set_cpu_bf16_dot(True) is False and ops.cpu_bf16_dot()
    finally:
        ops.set_cpu_bf16_dot(previous)
    script = "from pagedkv import ops; print(ops.cpu_bf16_dot())"
    for value, expected in (("0", "False"), ("1", "True")):
        run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PAGEDKV_CPU_BF16_DOT": value},
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == expected, run.stderr
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PAGEDKV_CPU_BF16_DOT": "yes"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "PAGEDKV_CPU_BF16_DOT must be 0 or 1" in run.stderr
