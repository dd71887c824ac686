"""The GEMM of the CPU linear layers: each weight packed once at load, for pagedkv's kernel or oneDNN's.

Decoding multiplies a handful of rows by every weight of the model once per step, so the
rate at which a GEMM reads its weights is the step's speed. pagedkv's own kernel
(`ops.packed_linear`: weights in panels of 48 output features, register tiles of several
input rows, bf16 on AVX512-BF16 dot products) read the default model's weights at ~30 GB/s for
1-8 rows where oneDNN's prepacked GEMM read 16-21 GB/s, and stayed ahead at every row
count up to prefill's (AMD Zen 4, 2026-12-03: bf16 1.64-1.88x at 1-8 rows, 1.15x at 512;
fp32 1.50-1.59x and 1.08x; see csrc/cpu/gemm_kernels.cpp). On an AVX2 Zen 3 (2026-12-04) it is
ahead where decoding lives and level to 0.9x at prefill sizes: fp32 1.2-1.4x at 1-64 rows;
bf16, its pairs widened to fp32 in registers, 1.7-1.9x at 1-8 rows against oneDNN's fp32 GEMM
on the weights' upcast (oneDNN has no bf16 GEMM there), 0.9x at 257-512, and it keeps the
weights in bf16 (half the memory); offline bf16 generation ran 1.06-1.33x faster on it.
It runs on every CPU; where it is not the measured faster one (bf16 on AVX-512 without
AVX512-BF16, not measured) oneDNN stays the default.

Which one: PAGEDKV_CPU_LINEAR_KERNEL = auto (the above) | pagedkv | onednn, read when a
weight is packed. PAGEDKV_CPU_PACKED_LINEAR=0 turns packing off (plain F.linear).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from pagedkv import ops

LINEAR_KERNELS = ("auto", "pagedkv", "onednn")


@functools.cache
def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_enabled() -> bool:
    return os.environ.get("PAGEDKV_CPU_PACKED_LINEAR", "1") != "0"


def pack_onednn_weight(weight: torch.Tensor, bf16_as_fp32: bool = False) -> torch.Tensor | None:
    """A CPU weight [out, in] reordered for oneDNN's GEMM, or None where that path is unavailable.

    oneDNN with a prepacked weight runs the small-M GEMMs of decoding 2-4x faster than
    the default BLAS path (measured on AVX2 and AVX-512 machines). fp32 always; bf16
    where the CPU has the instructions, and elsewhere, with bf16_as_fp32, as its exact
    fp32 upcast (twice the memory), which `onednn_linear` multiplies in fp32: the
    products of bf16 values are exact in fp32 and a bf16 GEMM accumulates in fp32 too,
    so the result is a bf16 GEMM's up to summation order. Torch's own bf16 GEMM on such
    a CPU (AVX2) ran the default model 5x slower than fp32.
    """
    if (weight.device.type != "cpu" or not packing_enabled() or not torch.backends.mkldnn.is_available()
            or weight.dtype not in (torch.float32, torch.bfloat16)):
        return None
    if bf16_as_fp32 and weight.dtype == torch.bfloat16 and not onednn_has_bf16():
        weight = weight.float()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except (RuntimeError, AttributeError):
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ packed^T (+ bias) in x's dtype; an fp32-packed bf16 weight (pack_onednn_weight's
    bf16_as_fp32) takes bf16 x through the fp32 GEMM and rounds the output to bf16 once."""
    if packed.dtype == torch.float32 and x.dtype == torch.bfloat16:
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, None if bias is None else bias.float(),
                                                 "none", [], "")
        return out.to(torch.bfloat16)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_kernel(dtype: torch.dtype) -> str:
    """The kernel a CPU weight of this dtype is packed for: "pagedkv" or "onednn" (module docstring)."""
    choice = os.environ.get("PAGEDKV_CPU_LINEAR_KERNEL", "auto")
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"PAGEDKV_CPU_LINEAR_KERNEL={choice!r}: expected one of {', '.join(LINEAR_KERNELS)}")
    if choice != "auto":
        return choice
    capability = ops.cpu_capability()
    if capability in ("avx512_bf16", "avx2") or (capability == "avx512" and dtype == torch.float32):
        return "pagedkv"
    return "onednn"


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight [out_features, in] in the layout of `kernel` ("pagedkv" or "onednn")."""

    data: torch.Tensor
    out_features: int
    kernel: str


def packable(weight: torch.Tensor) -> bool:
    """Whether a weight is packed at all: a CPU float32 / bfloat16 tensor, packing not turned off."""
    return weight.device.type == "cpu" and packing_enabled() and weight.dtype in (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A CPU float32 / bfloat16 weight packed for `linear_kernel(weight.dtype)`, or None (stays plain)."""
    if not packable(weight):
        return None
    kernel = linear_kernel(weight.dtype)
    if kernel == "pagedkv":
        return PackedWeight(ops.pack_linear_weight(weight.detach()), weight.shape[0], kernel)
    data = pack_onednn_weight(weight, bf16_as_fp32=True)
    return None if data is None else PackedWeight(data, weight.shape[0], kernel)


def pack_expert_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """One MoE expert's CPU weight [out, in] packed for `linear_kernel(weight.dtype)` as
    `ops.fused_moe` takes it (w13_packed / w2_packed), or None where it cannot be packed.

    Unlike `pack_weight`, oneDNN's packing stays in the weight's dtype (the op multiplies in
    hidden's dtype), so a bf16 expert on a CPU without oneDNN's bf16 path has none there.
    """
    if not packable(weight):
        return None
    if linear_kernel(weight.dtype) == "pagedkv":
        return ops.pack_linear_weight(weight.detach())
    return pack_onednn_weight(weight)


_packed_linear_op = torch.ops.pagedkv.packed_linear.default


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out_features] in x's dtype, on the kernel the weight was packed for.

    The model's [tokens, in] activations go straight to the op (no reshape or wrapper): a decode
    step makes ~600 of these calls, and each microsecond of Python is ~0.1 s of the offline bench.
    """
    if packed.kernel == "onednn":
        return onednn_linear(x, packed.data, bias)
    if x.dim() == 2 and x.stride(1) == 1:
        out = x.new_empty((x.shape[0], packed.out_features))
        _packed_linear_op(out, x, packed.data, bias)
        return out
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = ops.packed_linear(rows, packed.data, bias, packed.out_features)
    return out.view(*x.shape[:-1], packed.out_features)
