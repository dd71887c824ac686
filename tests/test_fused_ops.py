"""The fused per-layer ops (rms_norm, fused_add_rms_norm, rotary_embedding_and_cache, silu_and_mul,
gelu_and_mul, gelu_tanh_and_mul) vs pagedkv.reference, on the CPU (and on CUDA when a device and a
CUDA build are present).

Tolerances, stated per dtype: the kernels and the references accumulate in float32 and
round the same values at the same points, so they differ only by the order of the
float32 sum of squares (norms) or by FMA contraction (RoPE): float32 1e-5; 16-bit
results may land one ulp apart (bf16: 2^-8 relative, fp16: 2^-11 relative).
"""

from __future__ import annotations

import pagedkv
import pytest
import torch
from pagedkv import ops, reference
from pagedkv.kv_cache import KVCache
from pagedkv.model.rotary import RotaryEmbedding

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and pagedkv.built_with_cuda else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},  # one bf16 ulp
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},  # one fp16 ulp
}
BLOCK_SIZE = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- rms_norm / fused_add_rms_norm -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 33])
@pytest.mark.parametrize("hidden", [1, 7, 576, 1000])
def test_rms_norm_matches_reference(device, dtype, num_tokens, hidden):
    gen = _gen(hidden * 100 + num_tokens)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 33])
@pytest.mark.parametrize("hidden", [1, 7, 576, 1000])
def test_fused_add_rms_norm_matches_reference(device, dtype, num_tokens, hidden):
    gen = _gen(hidden * 100 + num_tokens + 1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    residual = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    # The residual is an add rounded once: identical to the reference, bit for bit.
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(x, expected_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided_rows_and_in_place(dtype):
    # Rows of a wider tensor (a row stride > hidden) are accepted; out may be the input.
    gen = _gen(5)
    wide = torch.randn(9, 700, generator=gen).to(dtype)
    original = wide.clone()
    x = wide[:, 50:626]
    weight = torch.rand(576, generator=gen).to(dtype)
    expected = reference.rms_norm(x, weight, 1e-6)
    ops.rms_norm(x, x, weight, 1e-6)
    torch.testing.assert_close(x, expected, **TOL[dtype])
    assert torch.equal(wide[:, :50], original[:, :50])  # the columns outside the view are untouched
    assert torch.equal(wide[:, 626:], original[:, 626:])


def test_rms_norm_matches_model_layer_bitwise_in_bf16():
    # The fused norm rounds where HF's LlamaRMSNorm does; only the float32 sum order differs,
    # so nearly every element is bit-identical to the unfused layer's output.
    from pagedkv.model.layers import RMSNorm

    gen = _gen(6)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(torch.rand(576, generator=gen) + 0.5)
    x = torch.randn(48, 576, generator=gen).to(torch.bfloat16)
    res = torch.randn(48, 576, generator=gen).to(torch.bfloat16)
    previous = ops.set_fused_ops(False)
    try:
        out_ref, res_ref = norm(x.clone(), res.clone())
    finally:
        ops.set_fused_ops(previous)
    out, res_out = norm(x.clone(), res.clone())
    assert torch.equal(res_out, res_ref)
    same = (out == out_ref).float().mean().item()
    assert same > 0.99, same
    torch.testing.assert_close(out, out_ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda x, w: (x.double(), w.double()), "not supported"),
        (lambda x, w: (x[None], w), "2-D"),
        (lambda x, w: (x.t(), w), "dense"),
        (lambda x, w: (x, w[:-1]), "weight must be"),
        (lambda x, w: (x, w.to(torch.bfloat16)), "differs from input dtype"),
        (lambda x, w: (x, w.to("meta")), "meta"),
    ],
)
def test_rms_norm_bad_inputs(make_args, message):
    x, w = make_args(torch.randn(4, 8), torch.ones(8))
    with pytest.raises(RuntimeError, match=message):
        ops.rms_norm(torch.empty(x.shape, dtype=x.dtype), x, w, 1e-6)


def test_fused_add_rms_norm_bad_inputs():
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="residual shape"):
        ops.fused_add_rms_norm(x, torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual dtype"):
        ops.fused_add_rms_norm(x, torch.randn(4, 8).half(), w, 1e-6)
    with pytest.raises(RuntimeError, match="epsilon"):
        ops.fused_add_rms_norm(x, torch.randn(4, 8), w, float("nan"))


# ---- silu_and_mul / gelu_and_mul / gelu_tanh_and_mul ----------------------------------------------

ACT_OPS = {"silu": ops.silu_and_mul, "gelu": ops.gelu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}
CPU_VARIANTS = ["default", "avx2", "avx512"]  # avx512_bf16 runs the avx512 fused kernels


@pytest.fixture(params=CPU_VARIANTS)
def fused_cpu_variant(request):
    if not ops.cpu_capability_runs(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    previous = ops.set_cpu_capability(request.param)
    yield request.param
    ops.set_cpu_capability(previous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACT_OPS))
@pytest.mark.parametrize("num_tokens, d", [(1, 1), (3, 7), (33, 1536), (5, 1000)])
def test_act_and_mul_matches_reference(fused_cpu_variant, device, dtype, activation, num_tokens, d):
    gen = _gen(num_tokens * 1000 + d)
    x = (torch.randn(num_tokens, 2 * d, generator=gen) * 4).to(dtype).to(device)
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype, device=device)
    ACT_OPS[activation](out, x)
    torch.testing.assert_close(out, reference.act_and_mul(x, activation), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_is_the_unfused_sequence_bit_for_bit(fused_cpu_variant, dtype):
    # PyTorch's CPU silu and the fused op share the formula and the rounding points, so the model's
    # 16-bit outputs do not move when the MLP switches to the fused op.
    x = (torch.randn(48, 2 * 1536, generator=_gen(11)) * 3).to(dtype)
    out = torch.empty(48, 1536, dtype=dtype)
    ops.silu_and_mul(out, x)
    assert torch.equal(out, torch.nn.functional.silu(x[:, :1536]).mul_(x[:, 1536:]))


def test_act_and_mul_strided_rows_and_model_path():
    # Rows of a wider tensor are accepted; the MLP's act_and_mul takes the fused op and agrees
    # with the unfused one.
    from pagedkv.model.decoder import act_and_mul

    wide = torch.randn(6, 40, generator=_gen(12))
    x = wide[:, 3:35]  # [6, 32]: gate 16, up 16, row stride 40
    out = torch.empty(6, 16)
    ops.gelu_tanh_and_mul(out, x)
    torch.testing.assert_close(out, reference.act_and_mul(x, "gelu_tanh"), **TOL[torch.float32])
    previous = ops.set_fused_ops(False)
    try:
        unfused = act_and_mul(x.contiguous(), "gelu_pytorch_tanh")
    finally:
        ops.set_fused_ops(previous)
    torch.testing.assert_close(act_and_mul(x.contiguous(), "gelu_pytorch_tanh"), unfused, **TOL[torch.float32])


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda x, o: (x.double(), o.double()), "not supported"),
        (lambda x, o: (x[None], o), "2-D"),
        (lambda x, o: (x[:, :7], o), "even and positive"),
        (lambda x, o: (x.t().contiguous().t(), o), "input rows must be dense"),
        (lambda x, o: (x, o[:3]), "out must be"),
        (lambda x, o: (x, o.half()), "differs from input dtype"),
        (lambda x, o: (x, o.to("meta")), "meta"),
        (lambda x, o: (x, x[:, :4]), "share memory"),
    ],
)
def test_act_and_mul_bad_inputs(make_args, message):
    x, out = make_args(torch.randn(4, 8), torch.empty(4, 4))
    with pytest.raises(RuntimeError, match=message):
        ops.silu_and_mul(out, x)


# ---- rotary_embedding_and_cache ---------------------------------------------------------------


def _rotary_case(num_tokens, num_heads, num_kv_heads, head_size, dtype, device, seed, rot_dim=None,
                 max_position=4096, num_blocks=None, fused_qkv=True):
    gen = _gen(seed)
    rot_dim = rot_dim or head_size
    cos_sin = RotaryEmbedding(rot_dim, max_position, 10000.0).cos_sin.to(device)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(device)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    if fused_qkv:  # strided views of one projection, as the model passes them
        q = qkv[:, :num_heads * head_size].view(num_tokens, num_heads, head_size)
        k = qkv[:, num_heads * head_size:(num_heads + num_kv_heads) * head_size].view(
            num_tokens, num_kv_heads, head_size)
        v = qkv[:, (num_heads + num_kv_heads) * head_size:].view(num_tokens, num_kv_heads, head_size)
    else:
        q = qkv[:, :num_heads * head_size].reshape(num_tokens, num_heads, head_size)
        k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
        v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    num_blocks = num_blocks or (num_tokens // BLOCK_SIZE + 3)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens: rotated, not cached
    return positions, q, k, v, key_cache, value_cache, slots.to(device), cos_sin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 33])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_and_cache_matches_reference(device, dtype, num_tokens, head_size, is_neox):
    case = _rotary_case(num_tokens, 9, 3, head_size, dtype, device, seed=head_size + num_tokens)
    positions, q, k, v, kc, vc, slots, cos_sin = case
    expected = [t.clone() for t in (q, k, kc, vc)]
    reference.rotary_embedding_and_cache(positions, expected[0], expected[1], v, expected[2], expected[3], slots,
                                         cos_sin, is_neox)
    ops.rotary_embedding_and_cache(positions, q, k, v, kc, vc, slots, cos_sin, is_neox)
    for actual, want in zip((q, k, kc, vc), expected, strict=True):
        torch.testing.assert_close(actual, want, **TOL[dtype])
    # Cached keys are exactly the rotated keys, cached values exactly the values.
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(kc[s // BLOCK_SIZE, s % BLOCK_SIZE], k[keep])
    assert torch.equal(vc[s // BLOCK_SIZE, s % BLOCK_SIZE], v[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_partial_rot_dim_and_separate_tensors(dtype):
    # rot_dim < head_size (the tail of each head passes through) and contiguous q/k/v.
    case = _rotary_case(17, 4, 2, 64, dtype, "cpu", seed=11, rot_dim=32, fused_qkv=False)
    positions, q, k, v, kc, vc, slots, cos_sin = case
    expected = [t.clone() for t in (q, k, kc, vc)]
    reference.rotary_embedding_and_cache(positions, expected[0], expected[1], v, expected[2], expected[3], slots,
                                         cos_sin)
    ops.rotary_embedding_and_cache(positions, q, k, v, kc, vc, slots, cos_sin)
    for actual, want in zip((q, k, kc, vc), expected, strict=True):
        torch.testing.assert_close(actual, want, **TOL[dtype])


def test_rotary_matches_the_model_rotation():
    # The fused op gives what the unfused model path (RotaryEmbedding.forward + reshape_and_cache) gives.
    positions, q, k, v, kc, vc, slots, cos_sin = _rotary_case(33, 9, 3, 64, torch.float32, "cpu", seed=3)
    rope = RotaryEmbedding(64, 4096, 10000.0)
    cos, sin = rope.lookup(positions, torch.float32)
    qk = rope(torch.cat([q, k], dim=1), cos, sin)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ops.reshape_and_cache(qk[:, 9:], v, kc_ref, vc_ref, slots)
    rope.rotate_and_cache(positions, q, k, v, KVCache(kc, vc), slots)
    torch.testing.assert_close(q, qk[:, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc, kc_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(vc, vc_ref)


def test_rotary_bad_inputs():
    def call(**changes):
        positions, q, k, v, kc, vc, slots, cos_sin = _rotary_case(5, 4, 2, 64, torch.float32, "cpu", seed=1,
                                                                  max_position=64, num_blocks=2)
        args = dict(positions=positions, query=q, key=k, value=v, key_cache=kc, value_cache=vc,
                    slot_mapping=slots, cos_sin_cache=cos_sin)
        args.update(changes)
        ops.rotary_embedding_and_cache(**args)

    with pytest.raises(RuntimeError, match="positions must be Long"):
        call(positions=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"positions\[2\] = 64 is outside the cos/sin table"):
        call(positions=torch.tensor([0, 1, 64, 3, 4]))
    with pytest.raises(RuntimeError, match="positions has 4 entries"):
        call(positions=torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 32 is outside the cache"):
        call(slot_mapping=torch.tensor([0, 32, -1, 3, 4]))
    with pytest.raises(RuntimeError, match="query dtype"):
        call(query=torch.randn(5, 4, 64).half())
    with pytest.raises(RuntimeError, match="query must be"):
        call(query=torch.randn(5, 4, 32))
    with pytest.raises(RuntimeError, match="key must be"):
        call(key=torch.randn(5, 3, 64))
    with pytest.raises(RuntimeError, match="cos_sin_cache must be float32"):
        call(cos_sin_cache=torch.randn(64, 64).double())
    with pytest.raises(RuntimeError, match="rot_dim must be even"):
        call(cos_sin_cache=torch.randn(64, 65))
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        call(query=torch.randn(5, 64, 4).transpose(1, 2))
    with pytest.raises(RuntimeError, match="meta"):
        call(query=torch.randn(5, 4, 64, device="meta"))


def test_rotary_skips_out_of_range_positions_with_checks_off():
    # With the index checks off the kernel trusts nothing it would read out of the table:
    # an out-of-range position leaves its token unrotated (still cached).
    positions, q, k, v, kc, vc, slots, cos_sin = _rotary_case(3, 4, 2, 64, torch.float32, "cpu", seed=2,
                                                              max_position=64)
    positions = torch.tensor([1, 1000, -5])
    q0 = q.clone()
    with ops.index_checks(False):
        ops.rotary_embedding_and_cache(positions, q, k, v, kc, vc, slots, cos_sin)
    assert torch.equal(q[1:], q0[1:])
    assert not torch.equal(q[0], q0[0])


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and pagedkv built with CUDA")
def test_cuda_device_mismatch_is_refused():
    positions, q, k, v, kc, vc, slots, cos_sin = _rotary_case(5, 4, 2, 64, torch.float16, "cuda", seed=4)
    with pytest.raises(RuntimeError, match="positions is on cpu"):
        ops.rotary_embedding_and_cache(positions.cpu(), q, k, v, kc, vc, slots, cos_sin)
    with pytest.raises(RuntimeError, match="cos_sin_cache is on cpu"):
        ops.rotary_embedding_and_cache(positions, q, k, v, kc, vc, slots, cos_sin.cpu())
    x = torch.randn(3, 576, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="weight is on cpu"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(576, dtype=torch.float16), 1e-6)
