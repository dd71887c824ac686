"""Typed wrappers around `torch.ops.pagedkv.*`, and their fake (meta) kernels.

Cache layout, per layer: `key_cache` and `value_cache`, each
`[num_blocks, block_size, num_kv_heads, head_size]`, contiguous. `block_tables`
int32 `[num_seqs, max_blocks_per_seq]` maps a sequence's logical block i to a
physical block; `seq_lens` int32 `[num_seqs]`; `slot_mapping` int64
`[num_tokens]` with slot = block_id * block_size + offset (negative: skip).

Supported: float32, float16, bfloat16; head sizes 64, 80, 96, 112, 128, 256;
block sizes 8, 16, 32; any num_heads / num_kv_heads ratio (MHA, GQA, MQA).

Attention options, on every attention op (trailing keyword arguments, off by default):
- `sliding_window=W` (W > 0): a query at position p attends only to keys at
  positions p - W < k <= p (W keys, itself included: HF transformers' convention,
  as in Mistral and Gemma 2). Decode queries sit at seq_len - 1; prefill token i
  of a sequence at seq_len - q_len + i. Keys before the window are never read,
  and the block-table entries of blocks wholly before the window of every query of
  a sequence are neither read nor index-checked: they may hold anything (-1, a
  freed block's id). Decode cost follows min(seq_len, W). 0: no window.
- `logits_soft_cap=c` (c > 0): each score s = scale * q.k becomes c * tanh(s / c)
  (Gemma 2's attn_logit_softcapping), before ALiBi and the softmax. 0: off.
Negative values are refused (RuntimeError naming the argument).

Quantized caches, on every op that reads or writes the cache (trailing keyword
arguments `kv_cache_dtype="auto", k_scale=None, v_scale=None`; the formats and
the block layout are in `pagedkv.kv_cache`): "fp8" / "fp8_e4m3" / "fp8_e5m2"
caches are float8 tensors with optional float32 [1] per-tensor scales (absent:
1.0); "int8_per_token_head" / "int4_per_token_head" caches are uint8 codes (int4:
last dim head_size / 2) with required float16 (scale, zero) planes
[num_blocks, block_size, num_kv_heads, 2] as k_scale / v_scale, which the cache
writers fill and the attention ops read. Query, out and the new tokens' K/V stay
in the compute dtype. `pagedkv.reference` quantizes and dequantizes by the same
rule (`quantize_kv`, `dequantize_kv`).

Index-value checks (block ids, seq_lens, slot_mapping, query_start_loc) cost a
device->host sync on CUDA: `set_index_checks(False)` / `with index_checks(False):`
turn them off (CPU and CUDA alike), and `validate_decode_metadata` /
`validate_prefill_metadata` check the metadata on the host instead (see
`pagedkv.index_checks`). With the checks off and explicit `max_seq_len` /
`max_query_len`, `paged_attention*`, `paged_prefill_attention` and
`reshape_and_cache` launch without a device->host sync and can be captured in a
CUDA graph. `copy_blocks` and `swap_blocks` are not capturable (they copy their
block mapping from the host).

CPU kernel variants: `cpu_capability()` names the one in use (`default`, `avx2`,
`avx512`, or `avx512_bf16`, whose bf16 kernels take Q.K^T on the CPU's bf16 dot
products, fp8 caches included, and read int8 caches on its int16 dot products,
AVX512-VNNI); `PAGEDKV_CPU_CAPABILITY=NAME` or `set_cpu_capability(NAME)` picks an
older one (tests, benchmarks). On CPUs with AMX-BF16, bf16 `packed_linear` products of
2 rows or more run on AMX tiles (`cpu_amx()`; `PAGEDKV_CPU_AMX=0` or `set_cpu_amx(False)`
turns them off).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pagedkv import _C
from pagedkv.index_checks import (  # noqa: F401  (re-exported: part of the ops API)
    index_checks,
    index_checks_enabled,
    set_index_checks,
    validate_decode_metadata,
    validate_prefill_metadata,
)

_ops = torch.ops.pagedkv

DEFAULT_PARTITION_SIZE = 512

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# PAGEDKV_FUSED_OPS=0 sends the model back to the unfused PyTorch sequences (to compare).
_fused_ops = os.environ.get("PAGEDKV_FUSED_OPS", "1") != "0"


def set_fused_ops(enabled: bool) -> bool:
    """Turns the model's use of the fused per-layer ops on or off; returns the previous setting."""
    global _fused_ops
    previous, _fused_ops = _fused_ops, bool(enabled)
    return previous


def fused_ops_supported(t: torch.Tensor) -> bool:
    """Whether the fused per-layer ops (`rms_norm`, `fused_add_rms_norm`, `rotary_embedding_and_cache`,
    `silu_and_mul` and the GeGLU ops) have a kernel for tensors like `t` (its device and dtype) and the
    model should use them."""
    if not _fused_ops or t.dtype not in _FUSED_DTYPES:
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and bool(_C.built_with_cuda))


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention, one query token per sequence, one pass over its context.

    out, query: [num_seqs, num_heads, head_size]; the last two dims dense.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size].
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs]
    (the query attends to positions 0..seq_len-1, or the last sliding_window of them;
    seq_len 0 gives zeros). max_seq_len: an upper bound of seq_lens. alibi_slopes:
    float32 [num_heads]. sliding_window, logits_soft_cap, kv_cache_dtype, k_scale,
    v_scale: see the module docstring. Writes `out` in place.
    """
    _ops.paged_attention_v1(out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                            alibi_slopes, sliding_window, logits_soft_cap, kv_cache_dtype, k_scale, v_scale)


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention split over partitions of the context, then reduced.

    For long contexts and few sequences. Scratch, with P >= ceil(max_seq_len / partition_size):
    exp_sums, max_logits: float32 [num_seqs, num_heads, P];
    tmp_out: [num_seqs, num_heads, P, head_size] in the query dtype.
    partition_size: 256, 512 or 1024. Partitions are fixed positions of a sequence; with a
    sliding window those wholly before it stay empty (never read by the reduce).
    Other arguments as in `paged_attention_v1`.
    """
    _ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables,
                            seq_lens, scale, max_seq_len, alibi_slopes, partition_size, sliding_window,
                            logits_soft_cap, kv_cache_dtype, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention that picks v1 or v2 for the shape and allocates scratch.

    Returns `out` ([num_seqs, num_heads, head_size], a new tensor unless `out` is given).
    `max_seq_len=None` computes it from `seq_lens` (a device sync on CUDA, so not
    capturable in a CUDA graph); pass it, with the index checks off, for a sync-free call.
    With a sliding window, min(max_seq_len, sliding_window) decides between v1 and v2.
    """
    result = _ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                  alibi_slopes, sliding_window, logits_soft_cap, kv_cache_dtype, k_scale, v_scale)
    if out is None:
        return result
    return out.copy_(result)


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention for several new tokens per sequence (prefill, chunked prefill, prefix hits).

    query, out: [num_tokens, num_heads, head_size], the sequences' new tokens concatenated;
    query_start_loc: int32 [num_seqs + 1], sequence s owns tokens
    query_start_loc[s]:query_start_loc[s+1]. seq_lens counts all tokens of a sequence,
    the new ones included, so new token i sits at position p = seq_len - q_len + i and
    attends causally to positions 0..p (sliding_window W > 0: p-W+1..p). The new
    tokens' K/V must already be in the cache (`reshape_and_cache` first).
    sliding_window, logits_soft_cap, kv_cache_dtype, k_scale, v_scale: see the module docstring.
    """
    _ops.paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                 scale, max_query_len, max_seq_len, sliding_window, logits_soft_cap, kv_cache_dtype,
                                 k_scale, v_scale)


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
    """Write new tokens' K/V into the paged cache (quantizing them for a quantized kv_cache_dtype).

    key, value: [num_tokens, num_kv_heads, head_size] (last dim dense);
    slot_mapping: int64 [num_tokens], slot = block_id * block_size + offset; negative slots are skipped.
    Per-token-head formats also write each token's (scale, zero) into k_scale / v_scale.
    """
    _ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
    key_scales: Sequence[torch.Tensor] | None = None,
    value_scales: Sequence[torch.Tensor] | None = None,
) -> None:
    """Copy whole blocks within each layer's cache, all layers in one call (copy-on-write).

    block_mapping: int64 [num_pairs, 2] of (src_block, dst_block). key_scales / value_scales:
    the per-token-head scale planes of each layer, copied with their blocks (fp8's per-tensor
    scales are not block data). The caches' bytes are copied whatever their format.
    """
    _ops.copy_blocks(list(key_caches), list(value_caches), block_mapping,
                     None if key_scales is None else list(key_scales),
                     None if value_scales is None else list(value_scales))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks from `src` to `dst` ([num_blocks, ...] each), across devices or not.

    GPU<->CPU copies are asynchronous on the current stream (pin the host cache
    for real overlap). block_mapping: int64 CPU tensor [num_pairs, 2] of (src_block, dst_block).
    """
    _ops.swap_blocks(src, dst, block_mapping)


# The CPU kernel variants, from the baseline up (csrc/cpu/cpu_capability.h).
CPU_CAPABILITIES = ("default", "avx2", "avx512", "avx512_bf16")


def cpu_capability() -> str:
    """The CPU kernel variant in use: one of CPU_CAPABILITIES."""
    return _ops.cpu_capability()


def set_cpu_capability(name: str) -> str:
    """Runs the CPU kernels of variant `name` from now on (process-wide); returns the previous one.

    RuntimeError if the CPU cannot run `name`. For tests and benchmarks: do not call
    it while another thread runs attention.
    """
    return _ops.set_cpu_capability(name)


def cpu_capability_runs(name: str) -> bool:
    """Whether this CPU can run kernel variant `name` (what `set_cpu_capability` would accept)."""
    try:
        previous = _ops.set_cpu_capability(name)
    except RuntimeError:
        return False
    _ops.set_cpu_capability(previous)
    return True


def runnable_cpu_capabilities() -> list[str]:
    """The CPU kernel variants this CPU runs, from the baseline up."""
    return [name for name in CPU_CAPABILITIES if cpu_capability_runs(name)]


def cpu_amx() -> bool:
    """Whether bf16 `packed_linear` products of many rows and bf16 prefill attention run on AMX tiles here.

    True where the CPU has AMX-BF16 (Sapphire Rapids and later), Linux grants the tile
    state, the variant in use is avx512_bf16, and neither `PAGEDKV_CPU_AMX=0` nor
    `set_cpu_amx(False)` turned it off.
    """
    return _ops.cpu_amx()


def set_cpu_amx(enabled: bool) -> bool:
    """Turns the AMX tile paths (bf16 `packed_linear`, bf16 prefill attention) on or off (process-wide); returns the
    previous setting. RuntimeError when enabling it on a CPU without AMX-BF16."""
    return _ops.set_cpu_amx(enabled)


def cpu_bf16_dot() -> bool:
    """Whether bf16 decode (avx512_bf16 variant) takes Q.K^T on `vdpbf16ps` rather than fp32 FMAs: over a bf16 cache
    at head sizes that are multiples of 32, over an fp8 one at multiples of 64 (off, int8 caches also pair P.V's
    codes at every head size).

    Which is faster depends on the CPU (`vdpbf16ps` costs about one FMA on AMD Zen 4, four on
    Intel Sapphire Rapids), so it is measured once per process; `PAGEDKV_CPU_BF16_DOT=0` or `1`
    decides instead. Both paths give the same results up to float rounding.
    """
    return _ops.cpu_bf16_dot()


def set_cpu_bf16_dot(enabled: bool) -> bool:
    """Sets `cpu_bf16_dot()` process-wide; returns the previous setting."""
    return _ops.set_cpu_bf16_dot(enabled)


def cpu_amx_runs() -> bool:
    """Whether this CPU can run the AMX tile path (what `set_cpu_amx(True)` would accept)."""
    try:
        previous = _ops.set_cpu_amx(True)
    except RuntimeError:
        return False
    _ops.set_cpu_amx(previous)
    return True


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """out <- input / rms(input) * weight, row by row, accumulated in float32.

    input, out: [num_tokens, hidden_size] (float32, float16, bfloat16), rows dense
    (stride 1 along hidden_size; any row stride); out may be input. weight:
    [hidden_size], the input dtype. 16-bit dtypes round x / rms(x) to the dtype
    before scaling by the weight, as HF's LlamaRMSNorm does.
    """
    _ops.rms_norm(out, input, weight, epsilon)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """In place, vLLM's semantics: residual <- input + residual; input <- rms_norm(residual) * weight.

    The sum is rounded to the dtype (as `residual.add_(input)` would) before its
    sum of squares is taken in float32. Shapes and dtypes as in `rms_norm`.
    """
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """vLLM's SwiGLU op: out <- silu(gate) * up, input = [gate | up].

    input [num_tokens, 2 d] (float32, float16, bfloat16), rows dense (any row
    stride, so a GEMM's output or a view of it); out [num_tokens, d], the same
    dtype, rows dense, not sharing memory with input. Computed in float32; the
    activation is rounded to the dtype before the product, as
    `F.silu(gate).mul_(up)` rounds it.
    """
    _ops.silu_and_mul(out, input)


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """GeGLU with the exact (erf) GELU: out <- gelu(gate) * up; shapes as in `silu_and_mul`."""
    _ops.gelu_and_mul(out, input)


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """GeGLU with the tanh GELU (Gemma's gelu_pytorch_tanh): out <- gelu_tanh(gate) * up."""
    _ops.gelu_tanh_and_mul(out, input)


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
    """RoPE on query and key in place, then the rotated key and the value into the paged cache.

    Replaces a rotary embedding followed by `reshape_and_cache`. positions: int64
    [num_tokens]; query [num_tokens, num_heads, head_size], key/value [num_tokens,
    num_kv_heads, head_size] (last dim dense; strided views of a fused QKV output are
    fine); cos_sin_cache: float32 [max_position, rot_dim], the cos of the rot_dim / 2
    pairs then their sin (`RotaryEmbedding.cos_sin`); the first rot_dim dims of each
    head rotate. is_neox: pairs (i, i + rot_dim/2) (rotate-half, Llama) or GPT-J's
    (2i, 2i+1). slot_mapping as in `reshape_and_cache` (negative: skip the cache
    write; the rotation still happens). Computes in float32, rounds once. A quantized
    kv_cache_dtype quantizes the rotated key and the value as `reshape_and_cache` does.
    """
    _ops.rotary_embedding_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping,
                                    cos_sin_cache, is_neox, kv_cache_dtype, k_scale, v_scale)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_packed: Sequence[torch.Tensor] | None = None,
              w2_packed: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """A mixture of SwiGLU experts with the routing already chosen: returns out [T, H].

    hidden [T, H] (float32, bfloat16 or float16); w13 [E, 2I, H], gate rows then up
    rows, and w2 [E, H, I], both hidden's dtype; topk_weights [T, K] float32 or
    hidden's dtype; topk_ids int32/int64 [T, K], each in [0, E) (checked).
    out[t] = sum_k topk_weights[t, k] * (silu(x W_g^T) * (x W_u^T)) W_2^T with
    x = hidden[t] and the weights of expert topk_ids[t, k]. The CPU kernel sorts
    the (token, slot) pairs by expert and runs two GEMMs per expert that has rows
    (grouped, no per-token work); the GEMMs and silu * up run in hidden's dtype,
    the weighted sum in float32. CPU only (`pagedkv.model.moe` falls back to a
    PyTorch loop elsewhere).

    w13_packed / w2_packed: optionally, each expert's w13[e] / w2[e] packed, for
    pagedkv's GEMM by `pack_linear_weight` or for oneDNN's by
    `torch.ops.mkldnn._reorder_linear_weight` (`cpu_linear.pack_expert_weight` picks);
    every expert with rows then runs on its packed weight, and the plain w13 / w2
    only give the shapes (they may be zero-stride placeholders).
    """
    return _ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_packed, w2_packed)


LINEAR_PANEL_WIDTH = 48  # output features per panel of a packed weight (csrc/cpu/gemm_kernels.h)


def sample_from_logits(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row (CPU): float32 logits [n, vocab] (dense rows), temperatures [n] (0: the row's
    first maximum, as `max(-1).indices`), uniforms [n] in [0, 1) -> int64 [n].

    A row with temperature T > 0 draws by inverting its distribution softmax(logits / T) at its
    uniform: the first token whose running sum of exp((logit - max) / T) reaches u times the total.
    Exactly the distribution, one random number per row, two passes over the row (the draw of
    `pagedkv.model.sampler` on the CPU, after its top-k / top-p / min-p filters when a batch has
    them); `reference.sample_from_logits` is the same in PyTorch, up to the rounding of the sums
    at a boundary between two tokens.
    """
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _ops.sample_from_logits(out, logits, temperatures, uniforms)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place (CPU): in logits row rows[i] every token whose bit in bitmask[i] is 0 gets -inf; returns logits.

    float32 logits [n, vocab] (dense rows); int32 bitmask [m, ceil(vocab / 32)], token t's bit being bit
    t % 32 of word t / 32 (as xgrammar's matchers fill it; the last word's bits past the vocabulary are
    ignored); int64 rows [m] in [0, n). Structured outputs' token masks (pagedkv.structured_outputs): a
    word with every bit set is skipped, a word of zeros filled at once, any other visits only its zero
    bits; rows split over the threads. `reference.apply_token_bitmask` is the same in PyTorch.
    """
    _ops.apply_token_bitmask(logits, bitmask, rows)
    return logits


def lora_linear_add(out: torch.Tensor, input: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_rows: torch.Tensor, slot_starts: torch.Tensor, slice_offsets: Sequence[int]) -> torch.Tensor:
    """In place: adds each row's LoRA adapter to a base linear's output out [T, N]; returns out.

    punica's SGMV (shrink, then expand), segmented by adapter slot. input [T, K]; lora_a
    [S, n_slices * R, K] (slice j of slot s: rows j*R .. (j+1)*R, R the max rank); lora_b
    [S, N, R], the LoRA scaling folded in; out, input, lora_a, lora_b one dtype (float32,
    bfloat16, float16) and device. slice_offsets: n_slices + 1 ints, 0 first, strictly
    increasing, N last: slice j owns out's columns slice_offsets[j] .. slice_offsets[j + 1]
    (a fused QKV projection has 3 slices, gate/up 2, a plain linear 1). token_rows int64 [M]:
    the rows of input/out that use an adapter, grouped by slot; slot_starts int64 [S + 1]
    (0 first, nondecreasing, M last): slot s owns token_rows[slot_starts[s]:slot_starts[s + 1]].
    Both on out's device. For each slot s with rows, xa = input[rows] @ lora_a[s]^T, then for
    each slice j, out[rows, cols_j] += xa[:, jR:(j+1)R] @ lora_b[s, cols_j, :]^T. Rows not
    listed are untouched (the base model); a row listed twice gets both updates.

    A slot whose rows are consecutive increasing rows works on views of input and out (one
    addmm_ per slice); others gather their rows and scatter-add the update. The index values
    are read on the host: on CUDA, slot_starts and token_rows are copied to the CPU once per
    call (a sync; the op cannot be captured in a CUDA graph). Value checks (slot_starts, rows
    in [0, T)) follow `set_index_checks`. `reference.lora_linear_add` is the same in PyTorch.
    """
    _ops.lora_linear_add(out, input, lora_a, lora_b, token_rows, slot_starts, list(slice_offsets))
    return out


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A CPU linear weight [out_features, in_features] (float32 or bfloat16) packed for `packed_linear`.

    The output features go in panels of 48 (the last padded with zeros); within a panel the
    inputs in order, a row of 48 weights each: float32 [ceil(N / 48), K, 48], bfloat16
    [ceil(N / 48), ceil(K / 2), 48, 2] with the inputs in pairs (K padded to even with a
    zero), as bf16 dot products take them. Same bytes as the weight, up to the padding.
    `pagedkv.reference.unpack_linear_weight` undoes it.
    """
    return _ops.pack_linear_weight(weight)


def packed_linear(input: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_features: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """input [M, K] @ weight^T (+ bias [N]) -> [M, N] on the CPU, from `pack_linear_weight(weight)`.

    input, bias and out share the weight's dtype (float32 or bfloat16); input and out need
    dense rows (any row stride). Sums in float32 (bfloat16 on AVX512-BF16 dot products where
    the CPU has them, on AMX tiles from 2 rows where it has AMX-BF16), bias added in float32,
    one rounding to the dtype. out_features
    defaults to the packed width (a multiple of 48); pass it, or `out`, for any other N.
    """
    if out is None:
        n = out_features if out_features is not None else packed_weight.shape[0] * LINEAR_PANEL_WIDTH
        out = input.new_empty((input.shape[0], n))
    _ops.packed_linear(out, input, packed_weight, bias)
    return out


# ---- fake kernels: shapes only, for torch.compile / FakeTensor tracing ----------


def _check_meta_consistent(op: str, data: dict[str, torch.Tensor | None], index: Sequence[torch.Tensor | None] = ()):
    """Refuse a call that mixes meta and real tensors.

    Such a call dispatches to the fake kernel below, which would silently write
    nothing into a real cache (or return an uninitialized real tensor), and the
    real kernels' device checks never run. All-meta data is shape propagation
    and fine; index tensors (block tables, mappings) may stay real then.
    """
    tensors = [*data.values(), *index]
    if not any(t is not None and t.device.type == "meta" for t in tensors):
        return
    for name, t in data.items():
        if t is not None and t.device.type != "meta":
            raise RuntimeError(f"{op}: {name} is on {t.device} but other arguments are on meta; meta tensors hold "
                               "no data, so pass every tensor on one real device")


@torch.library.register_fake("pagedkv::paged_attention")
def _paged_attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=None,
                          alibi_slopes=None, sliding_window=0, logits_soft_cap=0.0, kv_cache_dtype="auto",
                          k_scale=None, v_scale=None):
    data = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale,
            "v_scale": v_scale}
    _check_meta_consistent("paged_attention", data, (block_tables, seq_lens, alibi_slopes))
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("pagedkv::paged_attention_v1")
def _paged_attention_v1_fake(out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                             alibi_slopes=None, sliding_window=0, logits_soft_cap=0.0, kv_cache_dtype="auto",
                             k_scale=None, v_scale=None):
    data = {"out": out, "query": query, "key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale,
            "v_scale": v_scale}
    _check_meta_consistent("paged_attention_v1", data, (block_tables, seq_lens, alibi_slopes))


@torch.library.register_fake("pagedkv::paged_attention_v2")
def _paged_attention_v2_fake(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables,
                             seq_lens, scale, max_seq_len, alibi_slopes=None, partition_size=512, sliding_window=0,
                             logits_soft_cap=0.0, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    data = {"out": out, "exp_sums": exp_sums, "max_logits": max_logits, "tmp_out": tmp_out, "query": query,
            "key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale, "v_scale": v_scale}
    _check_meta_consistent("paged_attention_v2", data, (block_tables, seq_lens, alibi_slopes))


@torch.library.register_fake("pagedkv::paged_prefill_attention")
def _paged_prefill_attention_fake(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                  scale, max_query_len, max_seq_len, sliding_window=0, logits_soft_cap=0.0,
                                  kv_cache_dtype="auto", k_scale=None, v_scale=None):
    data = {"out": out, "query": query, "key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale,
            "v_scale": v_scale}
    _check_meta_consistent("paged_prefill_attention", data, (block_tables, query_start_loc, seq_lens))


@torch.library.register_fake("pagedkv::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None,
                            v_scale=None):
    data = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale,
            "v_scale": v_scale}
    _check_meta_consistent("reshape_and_cache", data, (slot_mapping,))


@torch.library.register_fake("pagedkv::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping, key_scales=None, value_scales=None):
    data = {f"key_caches[{i}]": t for i, t in enumerate(key_caches)}
    data |= {f"value_caches[{i}]": t for i, t in enumerate(value_caches)}
    data |= {f"key_scales[{i}]": t for i, t in enumerate(key_scales or ())}
    data |= {f"value_scales[{i}]": t for i, t in enumerate(value_scales or ())}
    _check_meta_consistent("copy_blocks", data, (block_mapping,))


@torch.library.register_fake("pagedkv::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    _check_meta_consistent("swap_blocks", {"src": src, "dst": dst}, (block_mapping,))


@torch.library.register_fake("pagedkv::rms_norm")
def _rms_norm_fake(out, input, weight, epsilon):
    _check_meta_consistent("rms_norm", {"out": out, "input": input, "weight": weight})


@torch.library.register_fake("pagedkv::fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon):
    _check_meta_consistent("fused_add_rms_norm", {"input": input, "residual": residual, "weight": weight})


def _act_and_mul_fake(op: str):
    def fake(out, input):
        _check_meta_consistent(op, {"out": out, "input": input})
    return fake


for _op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
    torch.library.register_fake(f"pagedkv::{_op}")(_act_and_mul_fake(_op))


@torch.library.register_fake("pagedkv::rotary_embedding_and_cache")
def _rotary_embedding_and_cache_fake(positions, query, key, value, key_cache, value_cache, slot_mapping,
                                     cos_sin_cache, is_neox=True, kv_cache_dtype="auto", k_scale=None, v_scale=None):
    data = {"query": query, "key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
            "cos_sin_cache": cos_sin_cache, "k_scale": k_scale, "v_scale": v_scale}
    _check_meta_consistent("rotary_embedding_and_cache", data, (positions, slot_mapping))


@torch.library.register_fake("pagedkv::fused_moe")
def _fused_moe_fake(hidden, w13, w2, topk_weights, topk_ids, w13_packed=None, w2_packed=None):
    data = {"hidden": hidden, "w13": w13, "w2": w2, "topk_weights": topk_weights}
    _check_meta_consistent("fused_moe", data, (topk_ids,))
    return hidden.new_empty(hidden.shape)


@torch.library.register_fake("pagedkv::sample_from_logits")
def _sample_from_logits_fake(out, logits, temperatures, uniforms):
    _check_meta_consistent("sample_from_logits", {"out": out, "logits": logits, "temperatures": temperatures,
                                                  "uniforms": uniforms})


@torch.library.register_fake("pagedkv::apply_token_bitmask")
def _apply_token_bitmask_fake(logits, bitmask, rows):
    _check_meta_consistent("apply_token_bitmask", {"logits": logits, "bitmask": bitmask, "rows": rows})


@torch.library.register_fake("pagedkv::lora_linear_add")
def _lora_linear_add_fake(out, input, lora_a, lora_b, token_rows, slot_starts, slice_offsets):
    _check_meta_consistent("lora_linear_add", {"out": out, "input": input, "lora_a": lora_a, "lora_b": lora_b},
                           (token_rows, slot_starts))


@torch.library.register_fake("pagedkv::pack_linear_weight")
def _pack_linear_weight_fake(weight):
    panels = -(-weight.shape[0] // LINEAR_PANEL_WIDTH)
    if weight.dtype == torch.bfloat16:
        return weight.new_empty((panels, -(-weight.shape[1] // 2), LINEAR_PANEL_WIDTH, 2))
    return weight.new_empty((panels, weight.shape[1], LINEAR_PANEL_WIDTH))


@torch.library.register_fake("pagedkv::packed_linear")
def _packed_linear_fake(out, input, packed_weight, bias=None):
    _check_meta_consistent("packed_linear", {"out": out, "input": input, "packed_weight": packed_weight,
                                             "bias": bias})
