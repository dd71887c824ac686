"""The CPU linear layers' oneDNN-packed GEMMs (pagedkv.model.layers), bf16 included on CPUs without bf16 GEMMs.

Where oneDNN has no bf16 GEMM (AVX2), a bf16 weight is packed as its exact fp32 upcast and multiplied in
fp32, the output rounded to bf16 once: a bf16 GEMM up to summation order. These tests hold it to that.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv.model import layers

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def _case(n: int, k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).bfloat16()
    w = (torch.randn(m, k, generator=g) / k ** 0.5).bfloat16()
    bias = torch.randn(m, generator=g).bfloat16()
    return x, w, bias


def _bf16_gemm(x, w, bias):
    """bf16 products exact in fp32, fp32 accumulation, one rounding to bf16: what a bf16 GEMM computes."""
    return (x.double() @ w.double().T + bias.double()).float().bfloat16()


@pytest.mark.parametrize("n,k,m", [(1, 64, 48), (7, 576, 1536), (48, 1536, 576), (33, 96, 49)])
def test_fp32_packed_bf16_weight_is_a_bf16_gemm(n, k, m):
    x, w, bias = _case(n, k, m, n * k + m)
    packed = layers.pack_linear_weight(w.float())  # what bf16_as_fp32 packs without native bf16
    out = layers.packed_linear(x, packed, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (n, m)
    # Only the summation order differs from the exact result: at most one bf16 rounding step apart.
    torch.testing.assert_close(out.float(), _bf16_gemm(x, w, bias).float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(layers.packed_linear(x, packed, None), layers.packed_linear(x, packed, None))


def test_bf16_weights_are_packed_on_every_cpu_with_bf16_as_fp32():
    x, w, bias = _case(5, 128, 40, 3)
    packed = layers.pack_linear_weight(w, bf16_as_fp32=True)
    assert packed is not None
    assert packed.dtype == (torch.bfloat16 if layers.onednn_has_bf16() else torch.float32)
    torch.testing.assert_close(layers.packed_linear(x, packed, bias).float(), _bf16_gemm(x, w, bias).float(),
                               atol=1e-2, rtol=8e-3)
    if not layers.onednn_has_bf16():  # without the flag a bf16 weight stays unpacked (the MoE op needs that)
        assert layers.pack_linear_weight(w) is None


def test_a_packed_bf16_layer_matches_its_unpacked_self():
    layer = layers.RowParallelLinear(96, 80, bias=False).bfloat16()
    layer.weight.data.copy_((torch.randn(80, 96, generator=torch.Generator().manual_seed(9)) / 10).bfloat16())
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(10)).bfloat16()
    before = layer(x)
    layer.pack_for_cpu()
    assert layer.weight is None and layer.packed_weight is not None
    torch.testing.assert_close(layer(x).float(), before.float(), atol=1e-2, rtol=8e-3)
