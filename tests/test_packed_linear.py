"""The CPU linear layers' GEMMs (pagedkv.model.cpu_linear): pagedkv's packed_linear op and oneDNN's.

`ops.packed_linear` is checked against `pagedkv.reference.packed_linear` (float64 on the unpacked
weight) under every CPU kernel variant this machine runs, on fresh random inputs with odd sizes
(N not a multiple of the 48-wide panels, odd K for the bf16 pairs, K past one 512-row chunk,
more rows than a task's block), strided input rows, and bad inputs. Where the CPU has AMX-BF16,
"amx" is one more variant: avx512_bf16 with bf16 products of 2 rows or more on AMX tiles
(csrc/cpu/gemm_amx.cpp); the others run with the tiles off. Where oneDNN has no bf16 GEMM
(AVX2), a bf16 weight goes to oneDNN as its exact fp32 upcast: a bf16 GEMM up to summation order.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv import ops, reference
from pagedkv.model import cpu_linear, layers

AMX = ops.cpu_amx_runs()
VARIANTS = ops.runnable_cpu_capabilities() + (["amx"] if AMX else [])
DTYPES = [torch.float32, torch.bfloat16]
# (M rows, N out, K in): one row; odd everything; N < one panel; K past a chunk (512 pair rows of bf16
# = K 1024, 512 rows of fp32 on AVX-512, 128 on AVX2), and exactly one AVX2 chunk; rows past a task's 256-row
# block and the 64-row split, and one row past a block (equal blocks of 88 rows and a last one of 81); rows
# that leave 1-3 past the AVX2 4-row tiles; 40 rows of bf16, which on AVX2 widen the panel (from 32 rows),
# with an odd K past three of its 64-pair chunks.
SHAPES = [(1, 48, 64), (5, 97, 7), (3, 1, 1), (9, 50, 1201), (300, 100, 64), (17, 576, 2049), (257, 97, 33),
          (6, 49, 129), (4, 96, 128), (7, 145, 257), (40, 50, 301)]


def use_variant(name: str) -> tuple[str, bool]:
    """Runs CPU variant `name` ("amx": avx512_bf16 with the AMX tiles on, the others with them off);
    returns what to restore."""
    previous = ops.set_cpu_capability("avx512_bf16" if name == "amx" else name)
    return previous, ops.set_cpu_amx(name == "amx") if AMX else False


def restore_variant(previous: tuple[str, bool]) -> None:
    ops.set_cpu_capability(previous[0])
    if AMX:
        ops.set_cpu_amx(previous[1])


@pytest.fixture
def variant(request):
    previous = use_variant(request.param)
    yield request.param
    restore_variant(previous)


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
        previous = use_variant(v)
        try:
            outs.append(ops.packed_linear(x, packed, bias, out_features=70))
        finally:
            restore_variant(previous)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


amx_only = pytest.mark.skipif(not AMX, reason="the CPU has no AMX-BF16 tiles")


# (M, N, K) for the AMX tiles: 2 rows (the fewest they take); whole 16-row tiles with K a multiple of
# 32 (read in place); a partial last row tile; K of 1, odd, one short of and one past a 32-input tile
# (the input padded, the panel's last B tile from scratch); N under one 16-feature column tile and
# ending inside the second and third; rows past a 256-row block.
AMX_SHAPES = [(2, 48, 32), (16, 96, 64), (33, 100, 576), (3, 1, 1), (17, 47, 31), (18, 49, 33), (5, 17, 63),
              (64, 33, 1537), (300, 130, 96), (260, 20, 40)]


@amx_only
@pytest.mark.parametrize("m,n,k", AMX_SHAPES)
def test_amx_tiles_match_the_reference_and_the_register_tiles(m, n, k):
    x, w, bias = _case(m, n, k, torch.bfloat16, 7 * m + 3 * n + k)
    packed = ops.pack_linear_weight(w)
    previous = use_variant("amx")
    try:
        assert ops.cpu_amx()
        amx = ops.packed_linear(x, packed, bias, out_features=n)
        ops.set_cpu_amx(False)
        registers = ops.packed_linear(x, packed, bias, out_features=n)
    finally:
        restore_variant(previous)
    expected = reference.packed_linear(x, packed, bias, n)
    torch.testing.assert_close(amx.float(), expected.float(), **_tolerance(torch.bfloat16, k))
    # Both sum in fp32 from the same bf16 products: at most an ulp of bf16 apart after rounding.
    torch.testing.assert_close(amx.float(), registers.float(), atol=1e-2, rtol=8e-3)


@amx_only
def test_amx_grouped_products_split_by_rows():
    """fused_moe's experts in one grouped call: products of 1 row (register tiles) beside ones of 2 and 19
    rows (AMX tiles), against the reference with the tiles on and off."""
    g = torch.Generator().manual_seed(3)
    T, E, H, inter = 11, 3, 96, 35
    hidden = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).bfloat16()
    # Expert 0 gets every token (11 rows), expert 1 one token, expert 2 the other ten (2 slots each).
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.where(torch.arange(T) == 0, 1, 2)], dim=1)
    weights = torch.full((T, 2), 0.5)
    want = reference.fused_moe(hidden, w13, w2, weights, ids)
    packs = [[ops.pack_linear_weight(w[e]) for e in range(E)] for w in (w13, w2)]
    for name in ("amx", "avx512_bf16"):
        previous = use_variant(name)
        try:
            got = ops.fused_moe(hidden, w13, w2, weights, ids, *packs)
        finally:
            restore_variant(previous)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_amx_switch():
    """cpu_amx() is on only with avx512_bf16 in use; set_cpu_amx(True) is refused where the CPU has no tiles."""
    if not AMX:
        assert not ops.cpu_amx()
        with pytest.raises(RuntimeError, match="AMX"):
            ops.set_cpu_amx(True)
        return
    previous = use_variant("amx")
    try:
        assert ops.cpu_amx()
        ops.set_cpu_capability("avx512")
        assert not ops.cpu_amx()
        ops.set_cpu_capability("avx512_bf16")
        assert ops.set_cpu_amx(False) is True and not ops.cpu_amx()
    finally:
        restore_variant(previous)


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
