"""Per-layer fp8 KV-cache scales: where a checkpoint keeps them, and calibrating them from a batch.

An fp8 cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) stores k / k_scale and
v / v_scale, one float32 scale per layer for K and one for V
(`pagedkv.kv_cache`). They come from, in order:

1. the checkpoint, under the names quantization tools write (compressed-tensors,
   ModelOpt, vLLM's own): `layers.{i}.self_attn.k_scale`, `...self_attn.k_proj.k_scale`,
   `...self_attn.qkv_proj.k_scale`, `...self_attn.attn.k_scale`, `...k_proj.output_scale`
   (and the v counterparts; a deprecated `kv_scale` serves both);
2. the first real batch (`calculate_kv_scales`), as vLLM computes them:
   amax(|k|) / K_SCALE_CONSTANT and amax(|v|) / V_SCALE_CONSTANT over the step's
   rotated keys and values of each layer (the headroom under fp8's largest value,
   448 for e4m3, leaves room for later tokens larger than the first batch's);
3. else 1.0.
"""

from __future__ import annotations

import re

import torch

from pagedkv.model.layers import read_whole

# vLLM's divisors for the dynamic scales (its K_SCALE_CONSTANT / V_SCALE_CONSTANT defaults).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# (layer, which) from a checkpoint name; `which` is "k", "v", or "kv" (the deprecated one scale for both).
_LAYER = r"(?:^|\.)layers\.(\d+)\.self_attn\."
_SCALE_NAMES = (
    (re.compile(_LAYER + r"(?:[kv]_proj\.|qkv_proj\.|attn\.)?([kv])_scale$"), None),
    (re.compile(_LAYER + r"([kv])_proj\.output_scale$"), None),
    (re.compile(_LAYER + r"(?:attn\.)?kv_scale$"), "kv"),
)
# Scales of the attention a KV cache does not use (fp8 queries, probabilities): recognised and dropped.
_UNUSED_SCALE = re.compile(_LAYER + r"(?:q_proj\.|qkv_proj\.|attn\.)?(?:q_scale|prob_output_scale)$|"
                           + _LAYER + r"q_proj\.output_scale$")


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k" | "v" | "kv") for a checkpoint tensor holding a KV-cache scale; (layer, "") for an
    attention scale the cache does not use; None for any other tensor."""
    for pattern, which in _SCALE_NAMES:
        m = pattern.search(name)
        if m:
            return int(m.group(1)), which or m.group(2)
    m = _UNUSED_SCALE.search(name)
    if m:
        return int(next(g for g in m.groups() if g is not None)), ""
    return None


def checkpoint_scale_value(tensor) -> float:
    """A scale tensor's value ([] or [1]; a per-head vector gives its largest entry, which saturates no head).

    `tensor`: a torch.Tensor or a lazily read checkpoint slice (pagedkv.model.loader.CheckpointSlice).
    """
    value = float(read_whole(tensor).float().abs().max())
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"a KV-cache scale must be a positive finite number, got {value}")
    return value


def fp8_scale_from(x: torch.Tensor, constant: float) -> torch.Tensor:
    """float32 [] scale amax(|x|) / constant (1.0 for an all-zero x, whose every scale is as good)."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax > 0, amax / constant, torch.ones_like(amax))


def calibrate_fp8_scales(kv_cache, key: torch.Tensor, value: torch.Tensor) -> None:
    """Writes this layer's k_scale / v_scale (fp32 [1] tensors of `kv_cache`, a pagedkv.kv_cache.KVCache) in place
    from the step's keys and values [num_tokens, num_kv_heads, head_size] (rotated keys: what is cached).

    In place, so that captured CUDA graphs, which read the scale tensors by address, see the new values.
    """
    kv_cache.k_scale.copy_(fp8_scale_from(key, K_SCALE_CONSTANT))
    kv_cache.v_scale.copy_(fp8_scale_from(value, V_SCALE_CONSTANT))
