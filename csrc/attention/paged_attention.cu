// Decode PagedAttention on CUDA: v1 (one pass over the context) and v2 (split
// over partitions of the context, then a reduce kernel).
//
// Instantiated set (the one of csrc/common/supported.h):
//   auto cache: dtype {float, half, bfloat16} x head_size {64, 80, 96, 112, 128, 256}
//     x query heads per CTA {1, 2, 4, 8} x {plain, window/soft-cap}   = 144 decode kernels
//   quantized caches: the same x format {fp8 e4m3, fp8 e5m2, int8, int4 per token head},
//     query heads per CTA {1, 2, 4} only                             = 432 decode kernels
//   + 3 reduce kernels (the reduce reads tmp_out in the query dtype, whatever the cache).
// Why: head_size is a template parameter because it fixes the per-lane register
// arrays (query and accumulator slices) and the 16-byte-vector lane mapping; the
// query-heads-per-CTA count fixes the size of those arrays (G = num_heads /
// num_kv_heads is rounded up to 1, 2, 4 or 8, and G > 8 is split into chunks of
// <= 8 heads across CTAs). block_size and partition_size are runtime values:
// they only enter index arithmetic, and templating on them would triple the
// set for no measurable gain. The window/soft-cap variant (kExtras) is a template flag so
// that the plain kernel (no window, no cap: the common case) keeps exactly its old code,
// registers and speed; the variant adds a per-token lower bound (the window's first key)
// and, when the cap is on, one tanh per score.
// The cache format (common/kv_cache_dtype.h) is a template parameter too, for the same
// reason: the auto instantiation is the unquantized kernel unchanged. A quantized variant
// keeps the lane mapping (one load = Vec16<T>::kElems values: 8 or 4 bytes of fp8 / int8
// codes, 4 or 2 bytes of int4, attention/kv_cache_vec.cuh), dequantizes in registers as the
// auto kernel unpacks, and adds per step one (scale, zero) word per token for the
// per-token-head formats. fp8's per-tensor scales are read from device memory at the start
// (no host sync, capturable) and folded into the query (K) and the output (V). Groups of
// more than 4 query heads per kv head run in chunks of <= 4 heads with a quantized cache:
// the 8-head variant is at the register cap, and it would double the quantized set.
// The prefill kernels (prefill_attention.cu) are
// templated on dtype x head_size x {plain, window/soft-cap} x format (180 kernels).
//
// Decode kernel layout. One CTA = (kv head, chunk of <= 8 query heads sharing
// it, sequence, partition); 4 warps. Every K/V row a CTA reads is used by all
// its query heads, so with GQA the cache is read once per group (not once per
// query head). Within a warp, a "lane group" of kGroup lanes (a power of two)
// covers one token's head_size elements with 16-byte loads; the warp handles
// 32 / kGroup tokens per pass and kPasses passes per step (kStep <= 8 tokens, so
// a step always lies inside one block). Warps take interleaved *blocks* of the
// partition: a warp reads a block id once per block, and reads the id of its
// next block one block ahead; K of the next step is loaded before the current
// step's math (register double-buffering) and V of the current step at its
// start, so the loads of one step overlap the dot products and softmax of the
// previous one. No integer division in the loop (block_size is a power of two).
// Each warp runs its own online softmax (running max m, sum l, accumulator); at
// the end the lane groups are summed with xor shuffles and the 4 warps merged
// through shared memory. Logits never go to shared memory, so v1 handles any
// context length with the same shared memory footprint (<= 33 KiB).
//
// Sliding window: a query at position seq_len - 1 attends to keys [first_key, seq_len)
// (common/window.h). v1 starts its block walk at first_key's block, masking (and not
// loading) the tokens before it; v2 partitions wholly before it return at once, and the
// reduce starts at the partition holding first_key, so those are never read: blocks
// before the window (freed, any id in the table) are not touched, and the work is
// min(seq_len, W) tokens.
//
// v2: partition p covers [p * partition_size, (p + 1) * partition_size); the
// last launched partition also covers any tail beyond it, so a seq_len above
// the max_seq_len the grid was sized for (possible with the index checks off)
// is still attended in full, without a device->host sync.
//
// Registers / occupancy on sm_90 (ptxas 13.0, 128 threads per CTA, 0 spill
// bytes in every instantiation; full table per instantiation in
// csrc/attention/resource_usage_sm90.md, regenerate with scripts/ptxas_report.py):
//   heads/CTA 1: 71-96 regs, 5-7 CTAs (20-28 warps) per SM
//   heads/CTA 2: 95-128 regs, 4-5 CTAs;   heads/CTA 4: 128-168 regs, 3-4 CTAs
//   heads/CTA 8: fp16/bf16 254-255 regs, fp32 182-243 regs: 2 CTAs (8 warps) per SM.
// The 8-head variants sit at the register cap: any added live state must be
// checked with the script (the per-lane query and accumulator slices alone are
// 2 x heads x dims-per-lane floats: 128 registers at 8 heads, fp16, head_size 128).
#include <algorithm>
#include <type_traits>

#include "attention/attention_launch.h"
#include "attention/attention_utils.cuh"
#include "attention/kv_cache_vec.cuh"
#include "common/window.h"

namespace pagedkv::cuda {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kMaxHeadsPerCta = 8;
// Quantized caches: the per-token (scale, zero) words and the dequantization temporaries
// would push the 8-head variant (at the register cap) into spills; 4 heads per CTA at most.
constexpr int kMaxHeadsPerCtaQuant = 4;
constexpr int kReduceChunk = 256;  // partitions whose weights are staged in shared memory at once
constexpr int kMinBlockSize = 8;   // smallest supported block size (csrc/common/supported.h); all are powers of two

struct DecodeParams {
  PagedKV kv;
  void* out;
  const void* query;
  int64_t out_stride;
  int64_t query_stride;
  const float* alibi_slopes;
  float scale;
  int num_heads;
  int group_size;       // num_heads / num_kv_heads
  int heads_per_chunk;  // query heads per CTA (<= kMaxHeadsPerCta)
  int num_chunks;       // ceil(group_size / heads_per_chunk)
  // v2 only; partition_size == 0 selects v1 (one partition = the whole context).
  int partition_size;
  int max_partitions;  // partition dim of the scratch tensors
  int num_partitions;  // partitions launched (grid z); the last one runs to seq_len
  int log2_block_size;
  int sliding_window;  // 0: none
  float soft_cap;      // 0: off
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
};

// The lane mapping of the decode kernel, fixed at compile time.
template <typename T, int D, int GC>
struct DecodeShape {
  static constexpr int kVec = Vec16<T>::kElems;      // elements per 16-byte load
  static constexpr int kVecsPerRow = D / kVec;        // 16-byte loads per K/V row
  static constexpr int kGroup = kVecsPerRow >= 32 ? 32 : pow2_ceil(kVecsPerRow);  // lanes per token
  static constexpr int kVecsPerLane = (kVecsPerRow + kGroup - 1) / kGroup;
  static constexpr int kDimsPerLane = kVecsPerLane * kVec;
  static constexpr int kTokensPerPass = 32 / kGroup;
  // Loads per lane per step: K and V, kPasses * kVecsPerLane each (K of the next
  // step is in flight during this step's math). Fewer passes when the per-lane
  // arrays are large, to stay clear of spills, and a step never spans more than
  // kMinBlockSize tokens, so that it always lies inside one block.
  static constexpr int kPassesWanted = (kVecsPerLane > 1 || (GC >= 8 && kDimsPerLane >= 8)) ? 2 : 4;
  static constexpr int kPasses = kPassesWanted * kTokensPerPass <= kMinBlockSize ? kPassesWanted
                                                                                   : kMinBlockSize / kTokensPerPass;
  static constexpr int kStep = kTokensPerPass * kPasses;  // tokens per warp step
  static_assert(D % kVec == 0, "head_size must be a multiple of the 16-byte vector");
  static_assert(32 % kGroup == 0, "lane groups must tile the warp");
  static_assert(kStep <= kMinBlockSize && kMinBlockSize % kStep == 0, "a step must lie inside one block");
};

// The registers of one step's K (or V) rows of a lane: the loaded vectors, and for the
// per-token-head formats each token's (scale, zero) word (nothing for auto / fp8).
template <typename T, int D, int GC, KVCacheDType F>
struct StepRows {
  using Shape = DecodeShape<T, D, GC>;
  typename KVVec<T, F>::Raw raw[Shape::kPasses][Shape::kVecsPerLane];
  RowPairs<F, Shape::kPasses> pairs;
};

// Loads one step's rows (K or V) of this lane: token pos0 + pp * TP + group, slices
// lane_in_group + k * kGroup (16 bytes each for auto; the same values in fewer bytes for a
// quantized F, kv_cache_vec.cuh). Tokens at or past `end`, before `start` (kExtras: the
// window's first key), and every token of a block id outside the cache, load zeros (their
// logits are masked in attend_step). base: the kv head's first row; plane: the kv head's
// first (scale, zero) pair (per-token-head F only). token_stride in cache elements.
template <typename T, int D, int GC, bool kExtras, KVCacheDType F>
__device__ __forceinline__ void load_kv_step(StepRows<T, D, GC, F>& rows, const typename KVVec<T, F>::Elem* base,
                                             const __half* plane, int block_id, int pos0, int start, int end,
                                             const PagedKV& kv, int64_t token_stride, int lane_in_group, int group) {
  using Shape = DecodeShape<T, D, GC>;
  using Raw = typename KVVec<T, F>::Raw;
  const bool block_ok = block_id >= 0 && block_id < kv.num_blocks;
  // pos0 is the first token of a step inside block `block_id`; its offset in the block:
  const int in_block = pos0 & (kv.block_size - 1);
  const int64_t slot0 = int64_t(block_id) * kv.block_size + in_block;
  const auto* row0 = base + slot0 * token_stride;
#pragma unroll
  for (int pp = 0; pp < Shape::kPasses; ++pp) {
    const int t = pp * Shape::kTokensPerPass + group;
    const bool ok = block_ok && pos0 + t < end && (!kExtras || pos0 + t >= start);
#pragma unroll
    for (int k = 0; k < Shape::kVecsPerLane; ++k) {
      const int c = lane_in_group + k * Shape::kGroup;
      rows.raw[pp][k] = (ok && c < Shape::kVecsPerRow)
                            ? load_raw<Raw>(row0 + t * token_stride + c * KVVec<T, F>::kStored)
                            : Raw{};
    }
    if constexpr (is_per_token_head(F)) {
      rows.pairs.bits[pp] = ok ? load_pair_bits(plane, (slot0 + t) * kv.num_kv_heads) : 0u;
    }
  }
}

// The (mul, zero) that dequantize pass pp of a step: the token's pair (per-token-head);
// fp8 and auto use (1, 0), fp8's tensor scales being folded into the query and the output.
template <typename T, int D, int GC, KVCacheDType F>
__device__ __forceinline__ float2 step_scale(const StepRows<T, D, GC, F>& rows, int pp) {
  if constexpr (is_per_token_head(F)) {
    return pair_of_bits(rows.pairs.bits[pp]);
  } else {
    return make_float2(1.f, 0.f);
  }
}

// One step of the online softmax: logits of the step's tokens for the GC heads (kExtras:
// soft-capped when soft_cap > 0, tokens before `start` masked), the running max / sum
// update, and acc += p * V.
template <typename T, int D, int GC, bool kExtras, KVCacheDType F>
__device__ __forceinline__ void attend_step(
    const StepRows<T, D, GC, F>& k_rows, const StepRows<T, D, GC, F>& v_rows,
    const float (&q)[GC][DecodeShape<T, D, GC>::kDimsPerLane], const float (&slope)[GC], float (&m)[GC],
    float (&l)[GC], float (&acc)[GC][DecodeShape<T, D, GC>::kDimsPerLane], int pos0, int start, int end,
    bool block_ok, int seq_len, float soft_cap, int lane_in_group, int group) {
  using Shape = DecodeShape<T, D, GC>;
  constexpr int VEC = Shape::kVec;
  constexpr int LG = Shape::kGroup;
  constexpr int NV = Shape::kVecsPerLane;
  constexpr int PP = Shape::kPasses;

  // Logits: partial dot products per lane, summed over the lane group.
  float logit[PP][GC];
#pragma unroll
  for (int pp = 0; pp < PP; ++pp) {
    const int pos = pos0 + pp * Shape::kTokensPerPass + group;
    const bool valid = block_ok && pos < end && (!kExtras || pos >= start);
    float kf[NV][VEC];
    const float2 ks = step_scale(k_rows, pp);
#pragma unroll
    for (int k = 0; k < NV; ++k) dequant_vec<T, F>(k_rows.raw[pp][k], kf[k], ks.x, ks.y);
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) dot = fmaf(q[g][k * VEC + e], kf[k][e], dot);
      }
      dot = warp_sum<1, LG>(dot);
      if constexpr (kExtras) {
        if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap);  // before ALiBi (Gemma 2)
      }
      logit[pp][g] = valid ? dot + slope[g] * float(pos - (seq_len - 1)) : -INFINITY;
    }
  }

  // Online softmax update; logit[][] becomes the probabilities p.
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    float step_max = logit[0][g];
#pragma unroll
    for (int pp = 1; pp < PP; ++pp) step_max = fmaxf(step_max, logit[pp][g]);
    step_max = warp_max<LG, 32>(step_max);  // over the tokens of the warp
    const float m_new = fmaxf(m[g], step_max);
    const float alpha = rescale_factor(m[g], m_new);
    m[g] = m_new;
    float p_sum = 0.f;
#pragma unroll
    for (int pp = 0; pp < PP; ++pp) {
      logit[pp][g] = exp_shifted(logit[pp][g], m_new);
      p_sum += logit[pp][g];
    }
    l[g] = l[g] * alpha + p_sum;
#pragma unroll
    for (int j = 0; j < Shape::kDimsPerLane; ++j) acc[g][j] *= alpha;
  }

#pragma unroll
  for (int pp = 0; pp < PP; ++pp) {
    float vf[NV][VEC];
    const float2 vs = step_scale(v_rows, pp);
#pragma unroll
    for (int k = 0; k < NV; ++k) dequant_vec<T, F>(v_rows.raw[pp][k], vf[k], vs.x, vs.y);
#pragma unroll
    for (int g = 0; g < GC; ++g) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][k * VEC + e] = fmaf(logit[pp][g], vf[k][e], acc[g][k * VEC + e]);
      }
    }
  }
}

// Minimum CTAs per SM of the decode kernel's launch bounds: 0 (ptxas's default register
// target) everywhere but fp32 queries on an e4m3 cache, head_size 256, 2 heads per CTA, where
// that target spills 16 bytes at 72 registers; 1 lifts the target (96 registers, no spill;
// csrc/attention/resource_usage_sm90.md).
template <typename T, int D, int GC, KVCacheDType F>
constexpr int decode_min_blocks() {
  return std::is_same_v<T, float> && D == 256 && GC == 2 && F == KVCacheDType::kFp8E4M3 ? 1 : 0;
}

template <typename T, int D, int GC, bool kExtras, KVCacheDType F>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks<T, D, GC, F>())
    paged_decode_kernel(const DecodeParams p) {
  using Shape = DecodeShape<T, D, GC>;
  constexpr int VEC = Shape::kVec;
  constexpr int VPR = Shape::kVecsPerRow;
  constexpr int LG = Shape::kGroup;
  constexpr int NV = Shape::kVecsPerLane;
  constexpr int NDIM = Shape::kDimsPerLane;

  __shared__ float s_acc[kDecodeWarps][GC][D];
  __shared__ float s_max[kDecodeWarps][GC];
  __shared__ float s_sum[kDecodeWarps][GC];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / LG;          // which token of a pass
  const int lane_in_group = lane % LG;  // which 16-byte slices of the row
  const int kv_head = blockIdx.x / p.num_chunks;
  const int chunk = blockIdx.x % p.num_chunks;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int head0 = kv_head * p.group_size + chunk * p.heads_per_chunk;
  const int num_q = min(p.heads_per_chunk, p.group_size - chunk * p.heads_per_chunk);

  // Clamped so that block_tables is never indexed past its row, whatever seq_lens holds.
  const int seq_len = max(0, min(p.kv.seq_lens[seq], p.kv.max_blocks_per_seq * p.kv.block_size));
  // The window's first key (0 without one): tokens before it are neither loaded nor attended.
  const int first_key = kExtras ? int(window_first_key(seq_len - 1, p.sliding_window)) : 0;
  int start = first_key;
  int end = seq_len;
  if (p.partition_size > 0) {
    const int part_start = part * p.partition_size;
    // The last launched partition also takes any tail past num_partitions * partition_size:
    // a seq_len above the max_seq_len the grid was sized for (possible with the index
    // checks off) costs time in one CTA instead of silently dropping those tokens.
    end = part == p.num_partitions - 1 ? seq_len : min(seq_len, part_start + p.partition_size);
    start = max(part_start, first_key);
    // Empty (past the sequence's end, or before its window): the reduce kernel never reads it.
    if (start >= end) return;
  }

  // fp8: the tensor scales, read from device memory here (no host sync), are folded into
  // the query (K) and the output (V) instead of being applied per element.
  float q_scale = p.scale;
  float v_mul = 1.f;
  if constexpr (is_fp8(F)) {
    q_scale *= fp8_mul(F, p.kv.k_scale);
    v_mul = fp8_mul(F, p.kv.v_scale);
  }

  // This lane's slices of the (pre-scaled) query rows, in fp32.
  float q[GC][NDIM];
  float slope[GC];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    const bool active = g < num_q;
    const T* q_row = static_cast<const T*>(p.query) + seq * p.query_stride + int64_t(head0 + g) * D;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = lane_in_group + k * LG;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        q[g][k * VEC + e] = (active && c < VPR) ? to_float(q_row[c * VEC + e]) * q_scale : 0.f;
      }
    }
    slope[g] = (active && p.alibi_slopes != nullptr) ? p.alibi_slopes[head0 + g] : 0.f;
  }

  float m[GC];          // running max (warp-uniform)
  float l[GC];          // running sum of this lane group's tokens
  float acc[GC][NDIM];  // running weighted sum of V over this lane group's tokens
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < NDIM; ++j) acc[g][j] = 0.f;
  }

  const int32_t* table = p.kv.block_tables + int64_t(seq) * p.kv.max_blocks_per_seq;
  using Elem = typename KVVec<T, F>::Elem;
  constexpr int kRowElems = D / values_per_element(F);  // cache elements of one kv head's row
  const int64_t token_stride = int64_t(p.kv.num_kv_heads) * kRowElems;
  const Elem* k_base = static_cast<const Elem*>(p.kv.key_cache) + int64_t(kv_head) * kRowElems;
  const Elem* v_base = static_cast<const Elem*>(p.kv.value_cache) + int64_t(kv_head) * kRowElems;
  const __half* k_plane = p.kv.k_plane + (is_per_token_head(F) ? 2 * kv_head : 0);
  const __half* v_plane = p.kv.v_plane + (is_per_token_head(F) ? 2 * kv_head : 0);

  // Warps take interleaved blocks (block_size is a power of two >= kStep, and partition
  // starts are block-aligned, so every step lies inside one block). A block id is read
  // once per block, one block ahead of its use; K of the next step is loaded before
  // the current step's math (register double-buffering), V of the current step at its
  // start, so both loads overlap the previous dot products / softmax.
  const int bs = p.kv.block_size;
  const int steps_per_block = bs / Shape::kStep;
  const int end_blk = (end + bs - 1) >> p.log2_block_size;
  int blk = (start >> p.log2_block_size) + warp;
  if (blk < end_blk) {
    int block_id = table[blk];
    int next_id = blk + kDecodeWarps < end_blk ? table[blk + kDecodeWarps] : -1;
    int sub = 0;  // step within the block
    StepRows<T, D, GC, F> k_cur, k_next, v_cur;
    load_kv_step<T, D, GC, kExtras, F>(k_cur, k_base, k_plane, block_id, blk * bs, start, end, p.kv, token_stride,
                                       lane_in_group, group);
    while (true) {
      const int pos0 = blk * bs + sub * Shape::kStep;  // first token of this step
      load_kv_step<T, D, GC, kExtras, F>(v_cur, v_base, v_plane, block_id, pos0, start, end, p.kv, token_stride,
                                         lane_in_group, group);
      // The next step of this warp: the next sub-step, or the first of its next block.
      int n_blk = blk, n_sub = sub + 1, n_id = block_id;
      if (n_sub == steps_per_block) {
        n_sub = 0;
        n_blk += kDecodeWarps;
        n_id = next_id;
        if (n_blk < end_blk) next_id = n_blk + kDecodeWarps < end_blk ? table[n_blk + kDecodeWarps] : -1;
      }
      const int n_pos0 = n_blk * bs + n_sub * Shape::kStep;
      const bool has_next = n_blk < end_blk && n_pos0 < end;
      if (has_next) {
        load_kv_step<T, D, GC, kExtras, F>(k_next, k_base, k_plane, n_id, n_pos0, start, end, p.kv, token_stride,
                                           lane_in_group, group);
      }
      const bool block_ok = block_id >= 0 && block_id < p.kv.num_blocks;
      attend_step<T, D, GC, kExtras, F>(k_cur, v_cur, q, slope, m, l, acc, pos0, start, end, block_ok, seq_len,
                                        p.soft_cap, lane_in_group, group);
      if (!has_next) break;
#pragma unroll
      for (int pp = 0; pp < Shape::kPasses; ++pp) {
#pragma unroll
        for (int k = 0; k < NV; ++k) k_cur.raw[pp][k] = k_next.raw[pp][k];
      }
      k_cur.pairs = k_next.pairs;  // (an empty struct for auto / fp8)
      blk = n_blk;
      sub = n_sub;
      block_id = n_id;
    }
  }

  // Sum the lane groups (same running max across the warp), then merge the warps.
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    l[g] = warp_sum<LG, 32>(l[g]);
#pragma unroll
    for (int j = 0; j < NDIM; ++j) acc[g][j] = warp_sum<LG, 32>(acc[g][j]);
  }
  if (group == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = lane_in_group + k * LG;
        if (c < VPR) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_acc[warp][g][c * VEC + e] = acc[g][k * VEC + e];
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      s_max[warp][g] = m[g];
      s_sum[warp][g] = l[g];
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_q * D; i += kDecodeThreads) {
    const int g = i / D;
    const int d = i % D;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_all = fmaxf(m_all, s_max[w][g]);
    float sum = 0.f;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float f = rescale_factor(s_max[w][g], m_all);
      sum += s_sum[w][g] * f;
      o += s_acc[w][g][d] * f;
    }
    // sum == 0: empty context (or every block id masked): the output is zeros.
    float result = sum > 0.f ? o / sum : 0.f;
    if constexpr (is_fp8(F)) result *= v_mul;
    const int head = head0 + g;
    if (p.partition_size == 0) {
      static_cast<T*>(p.out)[seq * p.out_stride + int64_t(head) * D + d] = from_float<T>(result);
    } else {
      const int64_t row = (int64_t(seq) * p.num_heads + head) * p.max_partitions + part;
      static_cast<T*>(p.tmp_out)[row * D + d] = from_float<T>(result);
      if (d == 0) {
        p.max_logits[row] = m_all;
        p.exp_sums[row] = sum;
      }
    }
  }
}

// Block-wide max / sum over kDecodeThreads threads; s_red holds kDecodeWarps floats.
__device__ float block_max(float x, float* s_red) {
  x = warp_max<1, 32>(x);
  if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = x;
  __syncthreads();
  float r = s_red[0];
#pragma unroll
  for (int w = 1; w < kDecodeWarps; ++w) r = fmaxf(r, s_red[w]);
  __syncthreads();  // s_red is reused by the caller
  return r;
}
__device__ float block_sum(float x, float* s_red) {
  x = warp_sum<1, 32>(x);
  if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = x;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) r += s_red[w];
  __syncthreads();
  return r;
}

// v2 reduce: one CTA per (head, sequence) combines the partitions of the
// sequence: out = sum_p exp_sums[p] * exp(max_logits[p] - M) * tmp_out[p] / sum(...).
// Partitions past the sequence's length, or wholly before its window, were never
// written and are not read: the sum starts at the partition of the window's first key.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_reduce_kernel(const DecodeParams p) {
  constexpr int kMaxDimsPerThread = 256 / kDecodeThreads;  // head_size <= 256
  __shared__ float s_weight[kReduceChunk];
  __shared__ float s_red[kDecodeWarps];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int head_size = p.kv.head_size;
  const int seq_len = max(0, min(p.kv.seq_lens[seq], p.kv.max_blocks_per_seq * p.kv.block_size));
  const int end_part = min(p.num_partitions, (seq_len + p.partition_size - 1) / p.partition_size);
  // Clamped to the last launched partition, which takes the tail of a seq_len above max_seq_len.
  const int first_part =
      min(int(window_first_key(seq_len - 1, p.sliding_window) / p.partition_size), max(end_part - 1, 0));
  const int num_parts = end_part - first_part;
  const int64_t row0 = (int64_t(seq) * p.num_heads + head) * p.max_partitions + first_part;
  const float* max_logits = p.max_logits + row0;
  const float* exp_sums = p.exp_sums + row0;
  const T* tmp_out = static_cast<const T*>(p.tmp_out) + row0 * head_size;

  float m_all = -INFINITY;
  for (int i = threadIdx.x; i < num_parts; i += kDecodeThreads) m_all = fmaxf(m_all, max_logits[i]);
  m_all = block_max(m_all, s_red);
  float sum = 0.f;
  for (int i = threadIdx.x; i < num_parts; i += kDecodeThreads) {
    sum += exp_sums[i] * rescale_factor(max_logits[i], m_all);
  }
  sum = block_sum(sum, s_red);
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;

  float o[kMaxDimsPerThread] = {};
  for (int base = 0; base < num_parts; base += kReduceChunk) {
    const int n = min(kReduceChunk, num_parts - base);
    __syncthreads();  // the previous chunk's weights are consumed
    for (int i = threadIdx.x; i < n; i += kDecodeThreads) {
      s_weight[i] = exp_sums[base + i] * rescale_factor(max_logits[base + i], m_all) * inv_sum;
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) {
      const float w = s_weight[i];
      const T* row = tmp_out + int64_t(base + i) * head_size;
#pragma unroll
      for (int k = 0; k < kMaxDimsPerThread; ++k) {
        const int d = threadIdx.x + k * kDecodeThreads;
        if (d < head_size) o[k] = fmaf(w, to_float(row[d]), o[k]);
      }
    }
  }
  T* out = static_cast<T*>(p.out) + seq * p.out_stride + int64_t(head) * head_size;
#pragma unroll
  for (int k = 0; k < kMaxDimsPerThread; ++k) {
    const int d = threadIdx.x + k * kDecodeThreads;
    if (d < head_size) out[d] = from_float<T>(o[k]);
  }
}

DecodeParams make_params(const DecodeArgs& a) {
  DecodeParams p{};
  p.kv = a.kv;
  p.out = a.out;
  p.query = a.query;
  p.out_stride = a.out_stride;
  p.query_stride = a.query_stride;
  p.alibi_slopes = a.alibi_slopes;
  p.scale = a.scale;
  p.sliding_window = a.sliding_window;
  p.soft_cap = a.logits_soft_cap;
  p.num_heads = a.num_heads;
  p.group_size = a.num_heads / a.kv.num_kv_heads;
  // Split large groups evenly into chunks of at most kMaxHeadsPerCta heads.
  const int max_heads = a.kv.format == KVCacheDType::kAuto ? kMaxHeadsPerCta : kMaxHeadsPerCtaQuant;
  p.num_chunks = (p.group_size + max_heads - 1) / max_heads;
  p.heads_per_chunk = (p.group_size + p.num_chunks - 1) / p.num_chunks;
  // block_size is a power of two (csrc/common/supported.h): the kernel shifts instead of dividing.
  while ((1 << p.log2_block_size) < a.kv.block_size) ++p.log2_block_size;
  return p;
}

template <typename T, int D, bool kExtras, KVCacheDType F>
void launch_decode_heads(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  const int hc = p.heads_per_chunk;
  if (hc == 1) {
    paged_decode_kernel<T, D, 1, kExtras, F><<<grid, kDecodeThreads, 0, stream>>>(p);
  } else if (hc == 2) {
    paged_decode_kernel<T, D, 2, kExtras, F><<<grid, kDecodeThreads, 0, stream>>>(p);
  } else if (F != KVCacheDType::kAuto || hc <= 4) {  // quantized: hc <= kMaxHeadsPerCtaQuant
    paged_decode_kernel<T, D, 4, kExtras, F><<<grid, kDecodeThreads, 0, stream>>>(p);
  } else {
    if constexpr (F == KVCacheDType::kAuto) paged_decode_kernel<T, D, 8, kExtras, F><<<grid, kDecodeThreads, 0, stream>>>(p);
  }
}

template <typename T, int D, KVCacheDType F>
void launch_decode(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  if (p.sliding_window > 0 || p.soft_cap > 0.f) return launch_decode_heads<T, D, true, F>(p, grid, stream);
  launch_decode_heads<T, D, false, F>(p, grid, stream);
}

cudaError_t launch_decode_any(const DecodeParams& p, DType dtype, dim3 grid, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(p.kv.head_size, [&](auto hs) {
      return dispatch_format(p.kv.format, [&](auto fmt) {
        launch_decode<T, decltype(hs)::value, decltype(fmt)::value>(p, grid, stream);
        return cudaGetLastError();
      });
    });
  });
}

}  // namespace

cudaError_t launch_paged_attention_v1(const DecodeArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.num_seqs > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  if (args.kv.block_size < kMinBlockSize || (args.kv.block_size & (args.kv.block_size - 1)) != 0) {
    return cudaErrorInvalidValue;
  }
  DecodeParams p = make_params(args);
  const dim3 grid(args.kv.num_kv_heads * p.num_chunks, args.num_seqs, 1);
  return launch_decode_any(p, args.dtype, grid, stream);
}

cudaError_t launch_paged_attention_v2(const DecodeArgs& args, const DecodeScratch& scratch, int max_seq_len,
                                      cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.num_seqs > kMaxGridYZ || scratch.partition_size <= 0) return cudaErrorInvalidConfiguration;
  if (args.kv.block_size < kMinBlockSize || (args.kv.block_size & (args.kv.block_size - 1)) != 0 ||
      scratch.partition_size % args.kv.block_size != 0) {
    return cudaErrorInvalidValue;
  }
  DecodeParams p = make_params(args);
  p.partition_size = scratch.partition_size;
  p.max_partitions = scratch.max_partitions;
  // At least one partition, so that a sequence longer than max_seq_len (index checks off)
  // is still attended in full by the last partition; never more than the scratch holds.
  p.num_partitions = std::min(std::max(1, (max_seq_len + scratch.partition_size - 1) / scratch.partition_size),
                              scratch.max_partitions);
  if (p.num_partitions > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  p.exp_sums = scratch.exp_sums;
  p.max_logits = scratch.max_logits;
  p.tmp_out = scratch.tmp_out;
  if (p.num_partitions > 0) {
    const dim3 grid(args.kv.num_kv_heads * p.num_chunks, args.num_seqs, p.num_partitions);
    const cudaError_t err = launch_decode_any(p, args.dtype, grid, stream);
    if (err != cudaSuccess) return err;
  }
  // The reduce runs even with no partition: it writes the zeros of empty sequences.
  const dim3 reduce_grid(args.num_heads, args.num_seqs);
  return dispatch_dtype(args.dtype, [&](auto t) {
    using T = decltype(t);
    paged_decode_reduce_kernel<T><<<reduce_grid, kDecodeThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::cuda
