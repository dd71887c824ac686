"""Rotary position embedding (RoPE), with the Llama-3, linear, YaRN (Qwen long context, DeepSeek) and LongRoPE
(Phi-3.5 / Phi-4) scaling rules.

The rotation is the "rotate half" (GPT-NeoX) form that HF's Llama, Mistral
and Qwen2 use: dims [0, d/2) pair with [d/2, d). cos/sin are tabulated once,
in float32, for every position up to the engine's max_model_len (the model's
max_position_embeddings when that is not known at load).

Where the fused kernel serves the dtype and device, `rotate_and_cache` rotates
q and k in place and writes k and v to the paged cache in one op
(`pagedkv.ops.rotary_embedding_and_cache`); elsewhere the model looks cos/sin
up once per step (`lookup`), rotates with `forward`, then calls
`reshape_and_cache`. Both pass the layer cache's `op_args` (its kv_cache_dtype
and scales; none for "auto"), so the kernels quantize what they write.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from pagedkv import ops
from pagedkv.kv_cache import KVCache
from pagedkv.model.kv_scales import calibrate_fp8_scales
from pagedkv.model.layers import read_whole

logger = logging.getLogger(__name__)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching positions by `factor`: 0.1 mscale ln(factor) + 1 (1 when not
    stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any],
                     max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): (inverse frequencies, cos/sin multiplier).

    Frequencies that turn more than beta_fast times within the pretraining length
    (original_max_position_embeddings) are kept, those turning fewer than beta_slow times are divided by
    `factor` (interpolated), and a linear ramp over the rotary dims blends the two between; cos and sin grow
    by yarn_mscale(factor), or mscale / mscale_all_dim's ratio (DeepSeek), or the config's attention_factor.
    Without `factor` the stretch is max_position_embeddings / original, as transformers reads it.
    """
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / original
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(rotations: float) -> float:  # the rotary dim whose wavelength fits `rotations` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    # 0 where a frequency is kept, 1 where it is interpolated (high == low: a step, not a division by zero).
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)).clamp(0, 1)
    inv_freq = rope_inv_freq(rotary_dim, theta, None)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = scaling.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
        else yarn_mscale(factor))
    return inv_freq, float(attention)


def rope_kind(scaling: dict[str, Any] | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind  # "su": LongRoPE's first name in Phi-3 configs


def longrope_factors(scaling: dict[str, Any], max_position: int,
                     max_model_len: int | None) -> tuple[bool, list[float], float]:
    """(whether the long factors are used, the per-frequency divisors, the cos/sin multiplier) of LongRoPE.

    One set of factors serves every position, chosen as vLLM does: the long factors when the engine's
    max_model_len (default: the model's max_position_embeddings) exceeds the pretraining length
    original_max_position_embeddings, else the short ones. HF switches per forward by the sequence
    length, which gives the same rotation for sequences wholly under or wholly over that length.
    The multiplier is the paper's sqrt(1 + ln(factor) / ln(original)) unless the config sets it.
    """
    original = scaling["original_max_position_embeddings"]
    long = (max_model_len or max_position) > original
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    return long, scaling["long_factor" if long else "short_factor"], attention


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies, scaled by `scaling` (HF's `rope_scaling` dict) where the rule
    depends on nothing else (LongRoPE depends on the sequence length: `rope_frequencies`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"unsupported rope scaling {kind!r}; pagedkv supports default, llama3, linear, yarn and "
                     "longrope")


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
                     max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """(float32 [head_dim / 2] inverse frequencies, cos/sin multiplier: 1 but for LongRoPE and YaRN) of any rule."""
    if rope_kind(scaling) == "yarn":
        return yarn_frequencies(head_dim, theta, scaling, max_position)
    if rope_kind(scaling) != "longrope":
        return rope_inv_freq(head_dim, theta, scaling), 1.0
    long, factors, mult = longrope_factors(scaling, max_position, max_model_len)
    inv_freq = rope_inv_freq(head_dim, theta, None)
    if len(factors) != inv_freq.numel():
        raise ValueError(f"longrope has {len(factors)} factors for {inv_freq.numel()} rotary frequencies")
    logger.info("LongRoPE: the %s factors for every position (max_model_len %s vs pretraining length %d), "
                "cos/sin x %.4f", "long" if long else "short", max_model_len or max_position,
                scaling["original_max_position_embeddings"], mult)
    return inv_freq / torch.tensor(factors, dtype=torch.float32), mult


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their positions: the first `rotary_dim` dims of each head (all by default;
    fewer with a partial rotary factor, as Phi models have)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None,
                 max_model_len: int | None = None) -> None:
        """max_model_len: the engine's longest sequence, when known: the table holds that many positions (not
        all max_position of them: Gemma 3's 131072 x 256 float32 are 128 MiB per table), and LongRoPE picks
        its factors by it."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        # mult: LongRoPE and YaRN scale cos and sin (HF's attention_scaling).
        inv_freq, mult = rope_frequencies(self.rotary_dim, theta, scaling, max_position, max_model_len)
        # max_model_len is at most the model's position limit (EngineArgs checks), which YaRN may put past
        # max_position_embeddings (ModelConfig.position_limit).
        rows = max_model_len or max_position
        freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
        # [rows, rotary_dim]: cos of the half-dims, then sin; one gather per step serves every layer.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mult, persistent=False)
        self.half = self.rotary_dim // 2

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [num_tokens] -> (cos, sin), each [num_tokens, 1, rotary_dim / 2], in `dtype`."""
        cs = self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cs[..., :self.half], cs[..., self.half:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] -> rotated, a new contiguous tensor (dims past rotary_dim copied)."""
        x1, x2 = x[..., :self.half], x[..., self.half:self.rotary_dim]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if self.rotary_dim < x.shape[-1]:
            out[..., self.rotary_dim:] = x[..., self.rotary_dim:]
        o1, o2 = out[..., :self.half], out[..., self.half:self.rotary_dim]
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
        return out

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """The fused path: q [T, heads, head_dim] and k rotated in place, k and v written to their slots."""
        ops.rotary_embedding_and_cache(positions, q, k, v, kv_cache.key, kv_cache.value, slot_mapping, self.cos_sin,
                                       True, **kv_cache.op_args)

    def apply(self, pos: StepPositions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
              slot_mapping: torch.Tensor, calibrate: bool = False) -> torch.Tensor:
        """Rotates q [T, heads, D] and k, writes k and v to the cache; returns the rotated q (q itself when fused).

        calibrate: an fp8 cache's k/v scales are first set from the rotated k and v (pagedkv.model.kv_scales),
        on the unfused path (the scales must be known before the write, which the fused op does in the same
        pass); one step per engine, so its cost does not matter.
        """
        if pos.fused and not calibrate:
            self.rotate_and_cache(pos.positions, q, k, v, kv_cache, slot_mapping)
            return q
        cos, sin = pos.cos_sin(self)
        k = self(k, cos, sin)
        if calibrate and kv_cache.format.is_fp8:
            calibrate_fp8_scales(kv_cache, k, v)
        ops.reshape_and_cache(k, v, kv_cache.key, kv_cache.value, slot_mapping, **kv_cache.op_args)
        return self(q, cos, sin)


def interleaved_to_halves(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The row order that turns one head's interleaved rotary dims into halves: int64 [head_dim].

    GPT-J-style checkpoints (GLM, Cohere) rotate dims (2i, 2i + 1) as pair i; the kernels pair dim i with
    i + rotary_dim / 2 (GPT-NeoX's order). Permuting each q and k head's projection rows (weights and bias)
    by this order makes one the other: q . k is a sum over dims and both sides move alike, so attention
    scores do not change; V and the output projection are untouched, and the cache holds keys permuted.

    Row j of the result is row order[j] of the checkpoint: 0, 2, ..., rotary_dim - 2, then 1, 3, ...,
    rotary_dim - 1, then the dims that do not rotate, as they are.
    """
    rotary = torch.arange(rotary_dim)
    return torch.cat([rotary[0::2], rotary[1::2], torch.arange(rotary_dim, head_dim)])


def permute_heads(tensor: torch.Tensor, num_heads: int, order: torch.Tensor) -> torch.Tensor:
    """Rows [num_heads * head_dim, ...] (a projection's weight or bias) -> each head's rows in `order`."""
    head_dim = order.numel()
    if tensor.shape[0] != num_heads * head_dim:
        raise ValueError(f"a q/k projection of {tuple(tensor.shape)} does not hold {num_heads} heads of {head_dim}")
    return tensor.reshape(num_heads, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)


def qk_rows_in_halves_order(name: str, tensor, num_heads: int, num_kv_heads: int, order: torch.Tensor):
    """A checkpoint's q_proj / k_proj weight or bias (a tensor or a lazy slice) with each head's rows permuted by
    `order` (interleaved_to_halves), and a per-head q/k norm's weight ([head_dim] or [heads, head_dim]) with its
    dims permuted alike (the norm runs before the rotation, on the permuted dims); any other tensor as given."""
    for part, heads in ((".q_proj.", num_heads), (".k_proj.", num_kv_heads)):
        if part in name:
            return permute_heads(read_whole(tensor), heads, order)
    if ".q_norm." in name or ".k_norm." in name:
        whole = read_whole(tensor)
        if whole.shape[-1] != order.numel():
            raise ValueError(f"{name}: a q/k norm of shape {tuple(whole.shape)} is not per head of {order.numel()}")
        return whole[..., order]
    return tensor


class NoRotation(nn.Module):
    """A NoPE layer's stand-in for RotaryEmbedding (SmolLM3: every fourth layer attends without positions):
    the same `apply`, which writes k and v to the cache and leaves q and k unrotated."""

    def apply(self, pos: StepPositions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
              slot_mapping: torch.Tensor, calibrate: bool = False) -> torch.Tensor:
        if calibrate and kv_cache.format.is_fp8:
            calibrate_fp8_scales(kv_cache, k, v)
        ops.reshape_and_cache(k, v, kv_cache.key, kv_cache.value, slot_mapping, **kv_cache.op_args)
        return q


class StepPositions:
    """One step's positions int64 [num_tokens], and each rotary table's cos/sin rows for them, looked up once per
    step and shared by every layer (only on the unfused path: the fused kernel reads the table itself)."""

    def __init__(self, positions: torch.Tensor, fused: bool, dtype: torch.dtype) -> None:
        self.positions, self.fused, self.dtype = positions, fused, dtype
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._query_scales: dict[tuple[float, int], torch.Tensor] = {}

    def query_scale(self, beta: float, length: int) -> torch.Tensor:
        """Llama 4 / Ministral 3's per-position query scale, 1 + beta * log(1 + floor(position / length)):
        [num_tokens, 1, 1] in the step's dtype, computed once per step for every layer."""
        key = (beta, length)
        scale = self._query_scales.get(key)
        if scale is None:
            floor = torch.div(self.positions, length, rounding_mode="floor").to(torch.float32)
            scale = (1.0 + beta * torch.log1p(floor)).to(self.dtype).view(-1, 1, 1)
            self._query_scales[key] = scale
        return scale

    def cos_sin(self, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows.get(id(rope))
        if rows is None:
            rows = self._rows[id(rope)] = rope.lookup(self.positions, self.dtype)
        return rows
