"""Pure-PyTorch reference implementations of every pagedkv op.

Slow and simple on purpose: gather K/V through the block table, softmax in
float32, no fusion. The tests compare the kernels against these on fresh
random inputs; users can do the same. Shapes and semantics are those of
`pagedkv.ops`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedkv.kv_cache import kv_cache_format

_FP16_MAX = 65504.0


def rotation_block(head_size: int) -> int:
    """The Walsh-Hadamard block of a rotated format's rows: the largest power of two dividing head_size."""
    return head_size & -head_size


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_size] (any float dtype) times the normalized Walsh-Hadamard matrix H (block-diagonal,
    blocks of rotation_block(head_size)), as float32 of x's shape. H is symmetric and orthonormal, so this
    function is its own inverse. The arithmetic is the kernels' bit for bit (csrc/common/row_rotation.h):
    stages h = 1, 2, ..., b/2 replace each pair (x[i], x[i + h]) of a 2h-group by their sum and difference,
    then one multiplication by float32(1 / sqrt(b)).
    """
    d = x.shape[-1]
    b = rotation_block(d)
    y = x.float().reshape(-1, b)
    h = 1
    while h < b:
        v = y.reshape(-1, b // (2 * h), 2, h)
        y = torch.stack([v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1]], dim=2).reshape(-1, b)
        h *= 2
    return (y * torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)).reshape(x.shape)


def rotates_rows(kv_cache_dtype: str) -> bool:
    """Whether a format stores its rows rotated by hadamard_rows (int4 per token and head)."""
    return kv_cache_format(kv_cache_dtype).rotated


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache codes of rows x [..., head_size] (any float dtype) in a quantized format, by the rule the
    kernels use bit for bit (`pagedkv.kv_cache`): returns (codes, plane).

    fp8: codes float8 [..., head_size] of clamp(x * (1 / scale), +-max) (scale: float32 [1], default 1.0),
    plane None. Per token and head: codes uint8 [..., head_size] (int4: [..., head_size / 2], element 2i
    in the low nibble), plane float16 [..., 2] of (scale, zero); int4 quantizes hadamard_rows(x).
    """
    fmt = kv_cache_format(kv_cache_dtype)
    xf = hadamard_rows(x) if rotates_rows(kv_cache_dtype) else x.float()
    if fmt.is_fp8:
        inv = 1.0 / (scale.float().reshape(()) if scale is not None else torch.tensor(1.0))
        limit = torch.finfo(fmt.element).max
        return (xf * inv).clamp(-limit, limit).to(fmt.element), None
    q = (1 << fmt.bits) - 1
    lo = xf.amin(-1, keepdim=True).clamp(-_FP16_MAX, _FP16_MAX)
    hi = xf.amax(-1, keepdim=True).clamp(-_FP16_MAX, _FP16_MAX)
    scale_h, zero_h = ((hi - lo) / q).half(), lo.half()
    s, z = scale_h.float(), zero_h.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = ((xf - z) * inv).round().clamp(0, q).to(torch.uint8)
    if fmt.values_per_element == 2:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, torch.cat([scale_h, zero_h], dim=-1)


def dequantize_kv(codes: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values [..., head_size] of cache codes (`quantize_kv`'s output; "auto": codes as they are).

    scale: fp8's float32 [1] per-tensor scale (None: 1.0), or the per-token-head plane [..., 2]. A rotated
    format's rows are rotated back (hadamard_rows), so this returns values in x's space, as attention reads them.
    """
    fmt = kv_cache_format(kv_cache_dtype)
    if not fmt.quantized:
        return codes.float()
    if fmt.is_fp8:
        return codes.float() * (scale.float().reshape(()) if scale is not None else 1.0)
    c = codes
    if fmt.values_per_element == 2:
        c = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    pair = scale.float()
    x = c.float() * pair[..., 0:1] + pair[..., 1:2]
    return hadamard_rows(x) if rotates_rows(kv_cache_dtype) else x


def _dequantized_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_cache_dtype: str,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """The caches as the attention ops read them: as given for "auto", else dequantized to float32."""
    if kv_cache_format(kv_cache_dtype).quantized:
        return dequantize_kv(key_cache, kv_cache_dtype, k_scale), dequantize_kv(value_cache, kv_cache_dtype, v_scale)
    return key_cache, value_cache


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_key: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions first_key..seq_len-1 of one sequence, contiguous: each
    [seq_len - first_key, num_kv_heads, head_size].

    block_table: int [max_blocks_per_seq] (the row of this sequence). Blocks wholly
    before first_key are not read (with a sliding window they may have been freed).
    """
    block_size = key_cache.shape[1]
    first_block = first_key // block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].long()
    offset = first_key - first_block * block_size
    k = key_cache[blocks].flatten(0, 1)[offset : seq_len - first_block * block_size]
    v = value_cache[blocks].flatten(0, 1)[offset : seq_len - first_block * block_size]
    return k, v


def check_window_and_soft_cap(sliding_window: int, logits_soft_cap: float) -> None:
    """ValueError unless sliding_window >= 0 and logits_soft_cap is finite and >= 0 (0: off)."""
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: no window), got {sliding_window}")
    if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be finite and >= 0 (0: no soft-capping), got {logits_soft_cap}")


def window_first_key(query_pos: int, sliding_window: int) -> int:
    """The first key a query at query_pos attends to: query_pos - sliding_window + 1 (>= 0), or 0 without a window."""
    return max(0, query_pos - sliding_window + 1) if sliding_window > 0 else 0


def alibi_bias(alibi_slopes: torch.Tensor, query_pos: torch.Tensor, key_len: int, first_key: int = 0) -> torch.Tensor:
    """ALiBi bias [num_heads, num_queries, key_len] of keys first_key..first_key+key_len-1:
    slope * (key_pos - query_pos)."""
    key_pos = torch.arange(first_key, first_key + key_len, device=alibi_slopes.device, dtype=torch.float32)
    dist = key_pos[None, :] - query_pos.float()[:, None]
    return alibi_slopes.float()[:, None, None] * dist[None]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    query_pos: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    first_key: int = 0,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q [n, num_heads, d] at positions query_pos [n] over k/v [L, num_kv_heads, d]
    holding positions first_key..first_key+L-1; sliding_window W > 0 also hides keys at or
    before query_pos - W; logits_soft_cap c > 0 maps each score s to c * tanh(s / c) before ALiBi.

    Returns float32 [n, num_heads, d].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, d]
    vf = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale  # [H, n, L]
    if logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        logits = logits + alibi_bias(alibi_slopes, query_pos, k.shape[0], first_key)
    key_pos = torch.arange(first_key, first_key + k.shape[0], device=q.device)
    mask = key_pos[None, :] > query_pos[:, None]  # [n, L]: future positions
    if sliding_window > 0:
        mask |= key_pos[None, :] <= query_pos[:, None] - sliding_window  # before the window
    logits = logits.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, vf)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (what v1, v2 and paged_attention compute). Returns [num_seqs, num_heads, head_size].

    The query of a sequence sits at position seq_len - 1; with sliding_window W > 0 it sees
    the last W positions only, and blocks before them are not read. A quantized cache is
    read dequantized (`dequantize_kv`).
    """
    check_window_and_soft_cap(sliding_window, logits_soft_cap)
    key_cache, value_cache = _dequantized_caches(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    out = torch.zeros_like(query)
    for s in range(query.shape[0]):
        seq_len = int(seq_lens[s])
        if seq_len == 0:
            continue
        first = window_first_key(seq_len - 1, sliding_window)
        k, v = gather_kv(key_cache, value_cache, block_tables[s], seq_len, first)
        pos = torch.tensor([seq_len - 1], device=query.device)
        out[s] = _attend(query[s : s + 1], k, v, scale, pos, alibi_slopes, first, sliding_window,
                         logits_soft_cap)[0].to(query.dtype)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over the cache. Returns [num_tokens, num_heads, head_size].

    New token i of a sequence sits at position seq_len - q_len + i; with sliding_window
    W > 0 it sees positions p - W + 1..p only, and blocks before the first token's
    window are not read. A quantized cache is read dequantized.
    """
    check_window_and_soft_cap(sliding_window, logits_soft_cap)
    key_cache, value_cache = _dequantized_caches(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    out = torch.zeros_like(query)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        if end == start:
            continue
        first = window_first_key(seq_len - (end - start), sliding_window)
        k, v = gather_kv(key_cache, value_cache, block_tables[s], seq_len, first)
        pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        out[start:end] = _attend(query[start:end], k, v, scale, pos, None, first, sliding_window,
                                 logits_soft_cap).to(query.dtype)
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_size] into their slots (negative: skip), quantized
    by `quantize_kv` for a quantized kv_cache_dtype (the per-token-head planes k_scale / v_scale written too)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    fmt = kv_cache_format(kv_cache_dtype)
    for new, cache, scale in ((key[keep], key_cache, k_scale), (value[keep], value_cache, v_scale)):
        if not fmt.quantized:
            cache[blocks, offsets] = new
            continue
        codes, plane = quantize_kv(new, kv_cache_dtype, scale if fmt.is_fp8 else None)
        cache[blocks, offsets] = codes
        if plane is not None:
            scale[blocks, offsets] = plane


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """input / rms(input) * weight [num_tokens, hidden_size], in float32; 16-bit dtypes round the
    normalized value to the dtype before the weight multiplies it (HF's LlamaRMSNorm)."""
    x = input.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    if input.dtype == torch.float32:
        return normed * weight.float()
    return weight * normed.to(input.dtype)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(input + residual) * weight, input + residual): the new input and residual.

    The sum is rounded to the dtype before it is normalized, as `residual.add_(input)` does.
    """
    new_residual = input + residual
    return rms_norm(new_residual, weight, epsilon), new_residual


# The gated activations of `ops.silu_and_mul`, `gelu_and_mul` and `gelu_tanh_and_mul`, by name.
GATED_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def act_and_mul(input: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up [*, d] for input = [gate | up] [*, 2 d], activation a key of GATED_ACTIVATIONS.

    Computed in float32; act(gate) is rounded to the input dtype before the product, which is rounded once.
    """
    d = input.shape[-1] // 2
    act = GATED_ACTIVATIONS[activation](input[..., :d].float()).to(input.dtype)
    return (act.float() * input[..., d:].float()).to(input.dtype)


def pack_linear_weight(weight: torch.Tensor, panel_width: int = 48) -> torch.Tensor:
    """The packed layout of `ops.pack_linear_weight`, in plain indexing: float32 [P, K, 48] with
    packed[p, k, c] = W[48 p + c, k]; bfloat16 [P, ceil(K / 2), 48, 2] with packed[p, j, c, e] =
    W[48 p + c, 2 j + e]; zeros where N or (bf16) K runs out."""
    n, k = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    panels, rows = -(-n // panel_width), -(-k // pair)
    packed = torch.zeros(panels, rows, panel_width, pair, dtype=weight.dtype)
    for p in range(panels):
        cols = weight[p * panel_width:(p + 1) * panel_width]  # [c, K]
        for e in range(pair):
            part = cols[:, e::pair]  # [c, elements e, e + pair, ...]
            packed[p, :part.shape[1], :cols.shape[0], e] = part.t()
    return packed if pair == 2 else packed.squeeze(-1)


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out_features, in_features] weight that `pack_linear_weight` packed."""
    if packed.dim() == 3:
        packed = packed.unsqueeze(-1)
    panels, rows, width, pair = packed.shape
    full = packed.permute(0, 2, 1, 3).reshape(panels * width, rows * pair)
    return full[:out_features, :in_features].clone()


def packed_linear(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """input [M, K] @ W^T + bias in float64 from the unpacked weight, rounded once to input's dtype."""
    weight = unpack_linear_weight(packed, out_features, input.shape[1])
    out = input.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(input.dtype)


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> torch.Tensor:
    """x [num_tokens, heads, head_size] rotated by positions (a new tensor, computed in float32).

    cos_sin_cache: float32 [max_position, rot_dim], cos of the rot_dim/2 pairs then their sin;
    the first rot_dim dims of each head rotate, pairs (i, i + rot_dim/2) or, not is_neox, (2i, 2i+1).
    """
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cs = cos_sin_cache[positions].unsqueeze(1)  # [T, 1, rot_dim]
    cos, sin = cs[..., :half], cs[..., half:]
    xf = x.float()
    rot = xf[..., :rot_dim]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, xf[..., rot_dim:]], dim=-1).to(x.dtype)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """RoPE on query and key in place, then `reshape_and_cache` of the rotated key and the value."""
    query.copy_(rotary_embedding(positions, query, cos_sin_cache, is_neox))
    key.copy_(rotary_embedding(positions, key, cos_sin_cache, is_neox))
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor,
    key_scales: Sequence[torch.Tensor] | None = None, value_scales: Sequence[torch.Tensor] | None = None,
) -> None:
    """For each (src, dst) row of block_mapping, copy block src to block dst in every layer (and in its
    per-token-head scale planes, when given).

    Destinations are unique and never also sources (the kernels copy the pairs concurrently
    and refuse such mappings), so the order of the rows does not matter.
    """
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches, *(key_scales or ()), *(value_scales or ())):
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """dst[d] = src[s] for each (s, d) row of block_mapping."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s])


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, as HF's Mixtral / Qwen3-MoE routers compute it.

    router_logits [T, E] -> (topk_weights float32 [T, top_k], topk_ids int64 [T, top_k]):
    softmax over all E experts in float32, the top_k largest (ties: torch.topk's order),
    divided by their sum when `renormalize` (Mixtral always; Qwen3-MoE when norm_topk_prob).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Mixture of SwiGLU experts, token by token and slot by slot (the definition `ops.fused_moe` must match).

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, K]; topk_ids [T, K] in [0, E). Each expert runs in the input
    dtype (its GEMMs and silu(gate) * up round there, as HF's do); the weighted sum
    over the K slots is taken in float32 and rounded once. Returns [T, H].
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = hidden[t] @ w13[e].t()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, k]) * (act @ w2[e].t()).float()
    return out.to(hidden.dtype)


def sample_from_logits(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`ops.sample_from_logits`: float32 logits [n, vocab], temperatures [n] (0: greedy), uniforms [n] in [0, 1).

    A greedy row takes its first maximum; any other row the first token whose cumulative weight
    exp((logit - max) / T) reaches u times the row's total (at least the smallest normal float, so
    a token of weight 0 is never picked); a row without a finite total (NaN logits) its last token.
    """
    greedy = temperatures == 0
    scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
    cdf = torch.exp(scaled - scaled.max(-1, keepdim=True).values).cumsum(-1)
    x = (uniforms.unsqueeze(1) * cdf[:, -1:]).clamp(min=torch.finfo(torch.float32).tiny)
    drawn = torch.searchsorted(cdf, x).squeeze(1).clamp(max=logits.shape[1] - 1)
    return torch.where(greedy, logits.max(-1).indices, drawn)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`ops.apply_token_bitmask`, in place on any device: in logits row rows[i] every token t whose bit t % 32 of
    int32 word bitmask[i, t // 32] is 0 gets -inf; returns logits."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab].to(logits.device)
    index = rows.to(logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
    return logits


def lora_linear_add(out: torch.Tensor, input: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_rows: torch.Tensor, slot_starts: torch.Tensor, slice_offsets: Sequence[int]) -> torch.Tensor:
    """`ops.lora_linear_add`, in place on any device: for each adapter slot s, the rows
    token_rows[slot_starts[s]:slot_starts[s + 1]] of out [T, N] get, per slice j (out's columns
    slice_offsets[j] .. slice_offsets[j + 1]), (input[rows] @ lora_a[s]^T)[:, jR:(j+1)R] @
    lora_b[s, cols_j, :]^T, each product rounded to out's dtype before it is added; returns out."""
    n_slices = len(slice_offsets) - 1
    rank = lora_b.shape[2]
    starts = slot_starts.tolist()
    for s in range(lora_a.shape[0]):
        rows = token_rows[starts[s]:starts[s + 1]]
        if rows.numel() == 0:
            continue
        xa = input[rows] @ lora_a[s].T
        for j in range(n_slices):
            lo, hi = slice_offsets[j], slice_offsets[j + 1]
            out[:, lo:hi].index_add_(0, rows, xa[:, j * rank:(j + 1) * rank] @ lora_b[s, lo:hi].T)
    return out
