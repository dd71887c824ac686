"""The CPU linear layers' GEMMs (pagedkv.model.cpu_linear): pagedkv's packed_linear op and oneDNN's.

`ops.packed_linear` is checked against `pagedkv.reference.packed_linear` (float64 on the unpacked
weight) under every CPU kernel variant this machine runs, on fresh random inputs with odd sizes
(N not a multiple of the 48-wide panels, odd K for the bf16 pairs, K past one 512-row chunk,
more rows than a task's block), strided input rows, and bad inputs. Where oneDNN has no bf16 GEMM
(AVX2), a bf16 weight goes to oneDNN as its exact fp32 upcast: a bf16 GEMM up to summation order.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv import ops, reference
from pagedkv.model import cpu_linear, layers

VARIANTS = ops.runnable_cpu_capabilities()
DTYPES = [torch.float32, torch.bfloat16]
# (M rows, N out, K in): one row; odd everything; N < one panel; K past a chunk (512 pair rows of bf16
# = K 1024, 512 rows of fp32 on AVX-512, 128 on AVX2), and exactly one AVX2 chunk; rows past a task's 256-row
# block and the 64-row split, and one row past a block (equal blocks of 88 rows and a last one of 81); rows
# that leave 1-3 past the AVX2 4-row tiles; 40 rows of bf16, which on AVX2 widen the panel (from 32 rows),
# with an odd K past three of its 64-pair chunks.
SHAPES = [(1, 48, 64), (5, 97, 7), (3, 1, 1), (9, 50, 1201), (300, 100, 64), (17, 576, 2049), (257, 97, 33),
          (6, 49, 129), (4, 96, 128), (7, 145, 257), (40, 50, 301)]


@pytest.fixture
def variant(request):
    previous = ops.set_cpu_capability(request.param)
    yield request.param
    ops.set_cpu_capability(previous)


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, w, bias


def _tolerance(dtype: torch.dtype, k: int) -> dict:
    # fp32: summation order over K terms of size ~1/sqrt(K); bf16: one rounding of the output.
    return dict(atol=1e-5 * k ** 0.5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_packed_linear_matches_reference(variant, dtype, m, n, k):
    x, w, bias = _case(m, n, k, dtype, m * 1000 + n * 10 + k)
    packed = ops.pack_linear_weight(w)
    assert torch.equal(packed, reference.pack_linear_weight(w))
    for b in (bias, None):
        out = ops.packed_linear(x, packed, b, out_features=n)
        assert out.dtype == dtype and out.shape == (m, n)
        expected = reference.packed_linear(x, packed, b, n)
        torch.testing.assert_close(out.float(), expected.float(), **_tolerance(dtype, k))


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_gets_the_same_bits_in_any_large_batch(variant, dtype):
    """Products of more than a tile of rows sum in one order: a row in a batch of 40 (bf16 on AVX2: widened
    panels), of 100 (the K rows visited in order) or of 300 (several row blocks) gives bit-identical outputs,
    as prefill chunks of different sizes need for a prompt's bits not to depend on how it was cut. Products
    of a few rows sum their K rows in interleaved segments (kStreams): within the tolerance of the order."""
    x, w, bias = _case(300, 61, 301, dtype, 13)
    packed = ops.pack_linear_weight(w)
    full = ops.packed_linear(x, packed, bias, out_features=61)
    assert torch.equal(ops.packed_linear(x[:40], packed, bias, out_features=61), full[:40])
    assert torch.equal(ops.packed_linear(x[100:200], packed, bias, out_features=61), full[100:200])
    for m in (1, 2, 3, 4):
        torch.testing.assert_close(ops.packed_linear(x[:m], packed, bias, out_features=61).float(),
                                   full[:m].float(), **_tolerance(dtype, 301))


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_linear_strided_rows_and_out(variant, dtype):
    x, w, bias = _case(7, 130, 90, dtype, 5)
    wide = torch.randn(7, 200).to(dtype)
    wide[:, 33:123] = x  # input rows with a stride of 200
    out = torch.full((7, 300), 7.0, dtype=dtype)
    ops.packed_linear(wide[:, 33:123], ops.pack_linear_weight(w), bias, out=out[:, 10:140])
    torch.testing.assert_close(out[:, 10:140].float(), reference.packed_linear(x, ops.pack_linear_weight(w), bias,
                                                                               130).float(), **_tolerance(dtype, 90))
    assert (out[:, :10] == 7).all() and (out[:, 140:] == 7).all()  # nothing written outside out's view


def test_packed_linear_zero_rows():
    w = torch.randn(20, 30)
    out = ops.packed_linear(torch.empty(0, 30), ops.pack_linear_weight(w), out_features=20)
    assert out.shape == (0, 20)


def test_variants_agree_on_fp32():
    """fp32 has one summation order over K in every variant (gemm_kernels.cpp, kStreams): equal results."""
    x, w, bias = _case(11, 70, 33, torch.float32, 8)
    packed = ops.pack_linear_weight(w)
    outs = []
    for v in VARIANTS:
        previous = ops.set_cpu_capability(v)
        try:
            outs.append(ops.packed_linear(x, packed, bias, out_features=70))
        finally:
            ops.set_cpu_capability(previous)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad,message", [
    (lambda x, p, b, o: (o, x.half(), p, b), "input dtype"),
    (lambda x, p, b, o: (o, x.t(), p, b), "must be \\[|rows must be dense"),
    (lambda x, p, b, o: (o, x[:, :-2], p, b), "packed_weight must have shape"),
    (lambda x, p, b, o: (o, x, p.bfloat16(), b), "packed_weight dtype"),
    (lambda x, p, b, o: (o, x, p[:, :-1], b), "packed_weight must have shape"),
    (lambda x, p, b, o: (o, x, p, b[:-1]), "bias must be"),
    (lambda x, p, b, o: (o, x, p, b.double()), "bias dtype"),
    (lambda x, p, b, o: (o[:-1], x, p, b), "out must be"),
    (lambda x, p, b, o: (o.double(), x, p, b), "out dtype"),
    (lambda x, p, b, o: (o.t().contiguous().t(), x, p, b), "out rows must be dense"),
    (lambda x, p, b, o: (o, x, p.transpose(0, 1).contiguous().transpose(0, 1), b), "contiguous"),
    (lambda x, p, b, o: (o, x.to("meta"), p, b), "meta"),
])
def test_packed_linear_refuses_bad_input(bad, message):
    x, w, bias = _case(4, 100, 96, torch.float32, 1)
    packed = ops.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedkv.packed_linear(*bad(x, packed, bias, torch.empty(4, 100)))


def test_packed_linear_refuses_out_overlapping_input():
    x = torch.randn(4, 200)
    packed = ops.pack_linear_weight(torch.randn(100, 100))
    with pytest.raises(RuntimeError, match="out must not share memory with input"):
        torch.ops.pagedkv.packed_linear(x[:, 50:150], x[:, :100], packed, None)


@pytest.mark.parametrize("bad,message", [
    (torch.randn(3), "must be 2-D"), (torch.randn(4, 5).half(), "dtype"), (torch.empty(0, 5), "empty"),
])
def test_pack_linear_weight_refuses_bad_input(bad, message):
    with pytest.raises(RuntimeError, match=message):
        ops.pack_linear_weight(bad)


# ---- the layers' choice of kernel ---------------------------------------------------------------


def _bf16_gemm(x, w, bias):
    """bf16 products exact in fp32, fp32 accumulation, one rounding to bf16: what a bf16 GEMM computes."""
    return (x.double() @ w.double().T + bias.double()).float().bfloat16()


onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@onednn
@pytest.mark.parametrize("n,k,m", [(1, 64, 48), (7, 576, 1536), (48, 1536, 576), (33, 96, 49)])
def test_fp32_packed_bf16_weight_is_a_bf16_gemm(n, k, m):
    x, w, bias = _case(n, m, k, torch.bfloat16, n * k + m)
    packed = cpu_linear.pack_onednn_weight(w.float())  # what bf16_as_fp32 packs without native bf16
    out = cpu_linear.onednn_linear(x, packed, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (n, m)
    # Only the summation order differs from the exact result: at most one bf16 rounding step apart.
    torch.testing.assert_close(out.float(), _bf16_gemm(x, w, bias).float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(cpu_linear.onednn_linear(x, packed, None), cpu_linear.onednn_linear(x, packed, None))


@onednn
def test_bf16_weights_are_packed_for_onednn_on_every_cpu_with_bf16_as_fp32():
    x, w, bias = _case(5, 40, 128, torch.bfloat16, 3)
    packed = cpu_linear.pack_onednn_weight(w, bf16_as_fp32=True)
    assert packed is not None
    assert packed.dtype == (torch.bfloat16 if cpu_linear.onednn_has_bf16() else torch.float32)
    torch.testing.assert_close(cpu_linear.onednn_linear(x, packed, bias).float(), _bf16_gemm(x, w, bias).float(),
                               atol=1e-2, rtol=8e-3)
    if not cpu_linear.onednn_has_bf16():  # without the flag a bf16 weight stays unpacked (the MoE op needs that)
        assert cpu_linear.pack_onednn_weight(w) is None


@pytest.mark.parametrize("kernel", ["pagedkv", pytest.param("onednn", marks=onednn)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_packed_layer_matches_its_unpacked_self(monkeypatch, kernel, dtype):
    monkeypatch.setenv("PAGEDKV_CPU_LINEAR_KERNEL", kernel)
    layer = layers.RowParallelLinear(96, 80, bias=True).to(dtype)
    g = torch.Generator().manual_seed(9)
    layer.weight.data.copy_(torch.randn(80, 96, generator=g) / 10)
    layer.bias.data.copy_(torch.randn(80, generator=g))
    x = torch.randn(2, 3, 96, generator=g).to(dtype)  # leading dims kept
    before = layer(x)
    layer.pack_for_cpu()
    assert layer.weight is None and layer.packed_weight.kernel == kernel
    after = layer(x)
    assert after.shape == (2, 3, 80)
    torch.testing.assert_close(after.float(), before.float(), **_tolerance(dtype, 96))


def test_auto_kernel_follows_the_cpu(monkeypatch):
    monkeypatch.setenv("PAGEDKV_CPU_LINEAR_KERNEL", "auto")
    capability = ops.cpu_capability()
    bf16 = "pagedkv" if capability in ("avx512_bf16", "avx2") else "onednn"
    fp32 = "pagedkv" if capability in ("avx2", "avx512", "avx512_bf16") else "onednn"
    assert cpu_linear.linear_kernel(torch.bfloat16) == bf16
    assert cpu_linear.linear_kernel(torch.float32) == fp32
    monkeypatch.setenv("PAGEDKV_CPU_LINEAR_KERNEL", "mkl")
    with pytest.raises(ValueError, match="PAGEDKV_CPU_LINEAR_KERNEL"):
        cpu_linear.linear_kernel(torch.float32)


def test_packing_off_keeps_the_plain_weight(monkeypatch):
    monkeypatch.setenv("PAGEDKV_CPU_PACKED_LINEAR", "0")
    assert cpu_linear.pack_weight(torch.randn(8, 8)) is None
