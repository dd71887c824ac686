// Prefill PagedAttention on CUDA: several new tokens per sequence, causal over
// the whole paged context (prompt prefill, chunked prefill, prefix-cache hits).
//
// Two kernels with one row mapping. fp16/bf16 run paged_prefill_mma_kernel
// (tensor cores, below); fp32 runs the SIMT kernel paged_prefill_kernel. Both
// stride over query tiles, so a q_len above max_query_len (index checks off)
// still writes every row. The dynamic shared-memory limit is raised once per
// (kernel, device), not per launch (ensure_smem_limit).
// sm_90, 0 spills everywhere (csrc/attention/resource_usage_sm90.md): tensor-core
// kernel 95-128 registers and 4-5 CTAs/SM for head_size <= 128, 238 registers and
// 2 CTAs/SM at 256 (101 KiB of shared memory); SIMT kernel 120-154 registers, 2-4 CTAs/SM.
//
// SIMT kernel. One CTA = (tile of query tokens, kv head [, chunk of its query heads], sequence).
// Its "rows" are (query token, query head) pairs: all G query heads that share
// the kv head, times as many query tokens as fit in kRows, so each K/V tile is
// loaded once from the cache and used by every row. K/V tiles of kKvTile tokens
// are converted to fp32 in shared memory; S = Q K^T, an online softmax per row
// (running max / sum in shared memory) and O += P V follow, with the causal
// mask key_pos <= query_pos. Instantiated for dtype x head_size x {plain, window/soft-cap}
// x cache format {auto, fp8 e4m3, fp8 e5m2, int8, int4 per token head} (180 kernels: 120
// tensor-core fp16/bf16, 60 SIMT fp32; see paged_attention.cu for the set and why the flag
// and the format are template parameters); block_size is a runtime value.
//
// Quantized caches (attention/kv_cache_vec.cuh): the SIMT kernel dequantizes K/V into its
// fp32 tiles as it stages them (same lane mapping: 4 codes per 4-value load); the
// tensor-core kernel cannot cp.async codes into its fp16/bf16 tiles, so it loads the codes
// of each 16-byte chunk (8 or 4 bytes), dequantizes them in fp32 and stores them rounded
// to the query dtype (one rounding, within the dtype's tolerance). Those loads are
// synchronous, so a quantized tile's loads overlap other warps' MMAs only.
//
// Sliding window (both kernels): a query tile's keys start at the window's first key of
// its first row (common/window.h), so blocks before it are never read (nor their table
// entries); later rows of the tile mask the keys before their own window per score.
#include "attention/attention_launch.h"
#include "attention/attention_utils.cuh"
#include "attention/kv_cache_vec.cuh"
#include "attention/mma.cuh"
#include "common/window.h"

#include <array>
#include <atomic>

namespace pagedkv::cuda {
namespace {

constexpr int kPrefillThreads = 128;
constexpr int kKvTile = 32;  // keys per shared-memory tile

struct PrefillParams {
  PagedKV kv;
  void* out;
  const void* query;
  int64_t out_stride;
  int64_t query_stride;
  const int32_t* query_start_loc;
  float scale;
  int num_tokens;
  int group_size;         // num_heads / num_kv_heads
  int heads_per_chunk;    // query heads of one kv head handled by a CTA
  int num_chunks;         // ceil(group_size / heads_per_chunk)
  int tokens_per_tile;    // query tokens per CTA: kRows / heads_per_chunk
  int log2_block_size;    // block_size is a power of two
  int sliding_window;     // 0: none
  float soft_cap;         // 0: off
};

// Whether key `key` (<= qpos) is inside the window of a query at qpos; always without a window.
__device__ __forceinline__ bool in_window(int key, int qpos, int window) { return window <= 0 || qpos - key < window; }

// c * tanh(s / c), Gemma 2's logit soft-capping; c > 0.
__device__ __forceinline__ float soft_cap_logit(float s, float c) { return c * tanhf(s / c); }

// One sequence's query rows and context, clamped so that no index leaves query/out or the
// block-table row, whatever the inputs hold. Both prefill kernels start from it.
struct SeqRange {
  int q_begin;  // its first row in query/out
  int q_len;    // its new tokens
  int seq_len;  // all its tokens, the new ones included
};

__device__ __forceinline__ SeqRange clamped_seq_range(const PrefillParams& p, int seq) {
  const int q_begin = min(max(p.query_start_loc[seq], 0), p.num_tokens);
  const int q_end = min(max(p.query_start_loc[seq + 1], q_begin), p.num_tokens);
  const int seq_len = max(0, min(p.kv.seq_lens[seq], p.kv.max_blocks_per_seq * p.kv.block_size));
  return {q_begin, q_end - q_begin, seq_len};
}

// One tile of a CTA's query rows: row r = (query token q0 + r / hc, query head
// r % hc of the CTA's chunk of num_q_heads heads); both prefill kernels walk tiles alike.
struct QueryTile {
  int q0, q_len, qt, hc, num_q_heads;
  int ctx_len;   // position of the sequence's first new token
  int kv_begin;  // keys [kv_begin, kv_end) are visible to some row of the tile: kv_begin is
  int kv_end;    // the window's first key of the tile's first row (0 without a window)

  // Position of row r's token in its sequence, or -1 when r is not a row of the tile.
  __device__ __forceinline__ int row_pos(int r) const {
    const int qi = r / hc;
    if (qi >= qt || r % hc >= num_q_heads || q0 + qi >= q_len) return -1;
    return max(-1, ctx_len + q0 + qi);
  }
};

__device__ __forceinline__ QueryTile query_tile(int q0, int q_len, int seq_len, int qt, int hc, int num_q_heads,
                                                int window) {
  const int ctx_len = seq_len - q_len;
  const int last_q = min(q0 + qt, q_len) - 1;
  const int kv_end = max(0, min(seq_len, ctx_len + last_q + 1));
  const int kv_begin = int(window_first_key(ctx_len + q0, window));
  return {q0, q_len, qt, hc, num_q_heads, ctx_len, kv_begin, kv_end};
}

template <int D>
struct PrefillShape {
  // Accumulator registers per thread = 4 rows x D / (kPrefillThreads / (kRows / 4)) dims.
  static constexpr int kRows = D <= 128 ? 64 : 32;
  static constexpr int kRowGroups = kRows / 4;  // a thread owns rows rg, rg + kRowGroups, ...
  static constexpr int kLd = D + 4;             // padded fp32 row: conflict-free float4 reads
  static constexpr int kSLd = kKvTile + 1;      // padded row of the score tile
  static constexpr int kCols = D / 4;           // float4 columns of a row
  static constexpr int kDimThreads = kPrefillThreads / kRowGroups;  // threads sharing 4 rows in O += P V
  static constexpr int kColsPerThread = (kCols + kDimThreads - 1) / kDimThreads;
  static constexpr int kRowThreads = kPrefillThreads / kRows;  // threads per row in the softmax update
  // S = Q K^T: a thread owns 4 rows x kKeysPerThread keys (keys strided by kKeyGroups), so
  // that every thread has scores to compute with 16 row groups (D <= 128) or 8 (D = 256).
  static constexpr int kKeyGroups = kPrefillThreads / kRowGroups;
  static constexpr int kKeysPerThread = kKvTile / kKeyGroups;
  static constexpr int kSmemFloats = kRows * kLd + 2 * kKvTile * kLd + kRows * kSLd + 3 * kRows;
  static constexpr size_t kSmemBytes = sizeof(float) * kSmemFloats + sizeof(int) * kKvTile;
  static_assert(kRows * kRowThreads == kPrefillThreads, "softmax rows split");
  static_assert(D % 4 == 0, "float4 columns");
  static_assert(kKeyGroups * kKeysPerThread == kKvTile, "score keys split");
};

// min blocks 1: without it ptxas caps this kernel at 128 registers and spills at
// head_size 256 (shared memory, not registers, bounds its occupancy anyway).
template <typename T, int D, bool kExtras, KVCacheDType F>
__global__ void __launch_bounds__(kPrefillThreads, 1) paged_prefill_kernel(const PrefillParams p) {
  using Shape = PrefillShape<D>;
  constexpr int kRows = Shape::kRows;
  constexpr int kRG = Shape::kRowGroups;
  constexpr int kLd = Shape::kLd;
  constexpr int kSLd = Shape::kSLd;
  constexpr int kKG = Shape::kKeyGroups;
  constexpr int kKT = Shape::kKeysPerThread;
  constexpr int VEC = Vec16<T>::kElems;
  constexpr int VPR = D / VEC;

  extern __shared__ float4 smem_f4[];
  float* s_q = reinterpret_cast<float*>(smem_f4);  // [kRows][kLd], pre-scaled
  float* s_k = s_q + kRows * kLd;                   // [kKvTile][kLd]
  float* s_v = s_k + kKvTile * kLd;                 // [kKvTile][kLd]
  float* s_p = s_v + kKvTile * kLd;                 // [kRows][kSLd]: scores, then probabilities
  float* s_m = s_p + kRows * kSLd;                  // running max per row
  float* s_l = s_m + kRows;                         // running sum per row
  float* s_alpha = s_l + kRows;                     // this tile's rescale factor per row
  int* s_ok = reinterpret_cast<int*>(s_alpha + kRows);  // key of the tile readable and in range

  const int tid = threadIdx.x;
  const int kv_head = blockIdx.y / p.num_chunks;
  const int chunk = blockIdx.y % p.num_chunks;
  const int seq = blockIdx.z;

  const SeqRange range = clamped_seq_range(p, seq);
  const int q_begin = range.q_begin, q_len = range.q_len, seq_len = range.seq_len;
  const int qt = p.tokens_per_tile;
  const int hc = p.heads_per_chunk;
  // Query tiles are strided over the grid: a q_len above the max_query_len the grid was
  // sized for (index checks off) costs time, never unwritten rows.
  for (int tile_q0 = blockIdx.x * qt; tile_q0 < q_len; tile_q0 += gridDim.x * qt) {
    __syncthreads();  // the previous query tile is done with the shared buffers
    const int head0 = kv_head * p.group_size + chunk * hc;
    const int num_q_heads = min(hc, p.group_size - chunk * hc);
    const QueryTile tile = query_tile(tile_q0, q_len, seq_len, qt, hc, num_q_heads, kExtras ? p.sliding_window : 0);
    const int kv_end = tile.kv_end;

    for (int i = tid; i < kRows * D; i += kPrefillThreads) {
      const int r = i / D;
      const int d = i % D;
      float x = 0.f;
      if (tile.row_pos(r) >= 0) {
        const T* q_row = static_cast<const T*>(p.query) + (q_begin + tile_q0 + r / hc) * p.query_stride +
                         int64_t(head0 + r % hc) * D;
        x = to_float(q_row[d]) * p.scale;
      }
      s_q[r * kLd + d] = x;
    }
    for (int r = tid; r < kRows; r += kPrefillThreads) {
      s_m[r] = -INFINITY;
      s_l[r] = 0.f;
    }
    __syncthreads();

    const int32_t* table = p.kv.block_tables + int64_t(seq) * p.kv.max_blocks_per_seq;
    using KV = KVVec<T, F>;
    using Elem = typename KV::Elem;
    constexpr int kRowElems = D / values_per_element(F);  // cache elements of one kv head's row
    const int64_t token_stride = int64_t(p.kv.num_kv_heads) * kRowElems;
    const Elem* k_base = static_cast<const Elem*>(p.kv.key_cache) + int64_t(kv_head) * kRowElems;
    const Elem* v_base = static_cast<const Elem*>(p.kv.value_cache) + int64_t(kv_head) * kRowElems;
    const float k_mul = is_fp8(F) ? fp8_mul(F, p.kv.k_scale) : 1.f;
    const float v_mul = is_fp8(F) ? fp8_mul(F, p.kv.v_scale) : 1.f;

    // O += P V ownership: rows rg + i * kRG (i < 4), float4 columns dg + j * kDimThreads.
    const int rg = tid / Shape::kDimThreads;
    const int dg = tid % Shape::kDimThreads;
    float4 acc[4][Shape::kColsPerThread];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < Shape::kColsPerThread; ++j) acc[i][j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    for (int kv0 = tile.kv_begin; kv0 < kv_end; kv0 += kKvTile) {
      // 1. Stage the K/V tile in fp32 (16-byte loads; unreadable keys become zeros, masked below).
      for (int i = tid; i < kKvTile * VPR; i += kPrefillThreads) {
        const int t = i / VPR;
        const int c = i % VPR;
        const int pos = kv0 + t;
        bool ok = pos < kv_end;
        int64_t slot = 0;
        if (ok) {
          const int block = table[pos / p.kv.block_size];
          ok = block >= 0 && block < p.kv.num_blocks;
          slot = int64_t(block) * p.kv.block_size + pos % p.kv.block_size;
        }
        const int64_t offset = slot * token_stride + c * KV::kStored;
        using Raw = typename KV::Raw;
        const Raw k_raw = ok ? load_raw<Raw>(k_base + offset) : Raw{};
        const Raw v_raw = ok ? load_raw<Raw>(v_base + offset) : Raw{};
        const int64_t row = slot * p.kv.num_kv_heads + kv_head;  // (scale, zero) pair of the row
        const float2 ks = row_scale<F>(p.kv.k_plane, row, k_mul, ok);
        const float2 vs = row_scale<F>(p.kv.v_plane, row, v_mul, ok);
        float kf[VEC];
        float vf[VEC];
        dequant_vec<T, F>(k_raw, kf, ks.x, ks.y);
        dequant_vec<T, F>(v_raw, vf, vs.x, vs.y);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          s_k[t * kLd + c * VEC + e] = kf[e];
          s_v[t * kLd + c * VEC + e] = vf[e];
        }
        if (c == 0) s_ok[t] = ok;
      }
      __syncthreads();

      // 2. Scores: each work item is 4 rows x kKT keys (rows strided by kRG, keys by kKG).
      for (int item = tid; item < kRG * kKG; item += kPrefillThreads) {
        const int irg = item / kKG;
        const int itg = item % kKG;
        float s[4][kKT] = {};
        for (int c = 0; c < D / 4; ++c) {
          float4 qv[4];
          float4 kv[kKT];
#pragma unroll
          for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float4*>(s_q + (irg + i * kRG) * kLd + 4 * c);
#pragma unroll
          for (int j = 0; j < kKT; ++j) kv[j] = *reinterpret_cast<const float4*>(s_k + (itg + kKG * j) * kLd + 4 * c);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < kKT; ++j) {
              s[i][j] = fmaf(qv[i].x, kv[j].x, s[i][j]);
              s[i][j] = fmaf(qv[i].y, kv[j].y, s[i][j]);
              s[i][j] = fmaf(qv[i].z, kv[j].z, s[i][j]);
              s[i][j] = fmaf(qv[i].w, kv[j].w, s[i][j]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = irg + i * kRG;
          const int qpos = tile.row_pos(r);
#pragma unroll
          for (int j = 0; j < kKT; ++j) {
            const int t = itg + kKG * j;
            bool visible = qpos >= 0 && kv0 + t <= qpos && s_ok[t];
            float score = s[i][j];
            if constexpr (kExtras) {
              visible = visible && in_window(kv0 + t, qpos, p.sliding_window);
              if (p.soft_cap > 0.f) score = soft_cap_logit(score, p.soft_cap);
            }
            s_p[r * kSLd + t] = visible ? score : -INFINITY;
          }
        }
      }
      __syncthreads();

      // 3. Online softmax per row: kRowThreads adjacent lanes share a row.
      {
        const int r = tid / Shape::kRowThreads;
        const int part = tid % Shape::kRowThreads;
        float* row = s_p + r * kSLd;
        float tile_max = -INFINITY;
        for (int t = part; t < kKvTile; t += Shape::kRowThreads) tile_max = fmaxf(tile_max, row[t]);
        tile_max = warp_max<1, Shape::kRowThreads>(tile_max);
        const float m_old = s_m[r];
        const float l_old = s_l[r];
        const float m_new = fmaxf(m_old, tile_max);
        float sum = 0.f;
        for (int t = part; t < kKvTile; t += Shape::kRowThreads) {
          const float pr = exp_shifted(row[t], m_new);
          row[t] = pr;
          sum += pr;
        }
        sum = warp_sum<1, Shape::kRowThreads>(sum);
        const float alpha = rescale_factor(m_old, m_new);
        __syncwarp();  // every lane of the row has read s_m / s_l
        if (part == 0) {
          s_m[r] = m_new;
          s_l[r] = l_old * alpha + sum;
          s_alpha[r] = alpha;
        }
      }
      __syncthreads();

      // 4. O = O * alpha + P V.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = s_alpha[rg + i * kRG];
#pragma unroll
        for (int j = 0; j < Shape::kColsPerThread; ++j) {
          acc[i][j].x *= a;
          acc[i][j].y *= a;
          acc[i][j].z *= a;
          acc[i][j].w *= a;
        }
      }
      for (int t = 0; t < kKvTile; ++t) {
        float pr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) pr[i] = s_p[(rg + i * kRG) * kSLd + t];
#pragma unroll
        for (int j = 0; j < Shape::kColsPerThread; ++j) {
          const int c = dg + j * Shape::kDimThreads;
          if (c < Shape::kCols) {
            const float4 v = *reinterpret_cast<const float4*>(s_v + t * kLd + 4 * c);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[i][j].x = fmaf(pr[i], v.x, acc[i][j].x);
              acc[i][j].y = fmaf(pr[i], v.y, acc[i][j].y);
              acc[i][j].z = fmaf(pr[i], v.z, acc[i][j].z);
              acc[i][j].w = fmaf(pr[i], v.w, acc[i][j].w);
            }
          }
        }
      }
      __syncthreads();  // the next tile overwrites s_k, s_v, s_p
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = rg + i * kRG;
      if (tile.row_pos(r) < 0) continue;
      const float l = s_l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // l == 0: every key masked (bad block ids): zeros
      T* o_row = static_cast<T*>(p.out) + (q_begin + tile_q0 + r / hc) * p.out_stride + int64_t(head0 + r % hc) * D;
#pragma unroll
      for (int j = 0; j < Shape::kColsPerThread; ++j) {
        const int c = dg + j * Shape::kDimThreads;
        if (c < Shape::kCols) {
          o_row[4 * c + 0] = from_float<T>(acc[i][j].x * inv);
          o_row[4 * c + 1] = from_float<T>(acc[i][j].y * inv);
          o_row[4 * c + 2] = from_float<T>(acc[i][j].z * inv);
          o_row[4 * c + 3] = from_float<T>(acc[i][j].w * inv);
        }
      }
    }
  }
}

// ---- tensor-core kernel (fp16 / bf16) ---------------------------------------------
//
// One CTA = 4 warps = 64 rows (same (token, head) row mapping as the SIMT kernel);
// warp w owns rows 16w..16w+15 as the M dimension of m16n8k16 MMAs. Per KV tile of
// kMmaKvTile keys: S = Q K^T (k = head dims), scale and mask in fp32, online softmax
// on the S fragments (a row's values sit in one lane quad), then O += P V with P
// taken straight from the S registers (see mma.cuh). Q stays in shared memory as T;
// K/V tiles are staged with cp.async in two stages, so the next tile streams in
// while this one is used. Accumulation is fp32 throughout; P is rounded to T for
// the P V product (as every tensor-core attention kernel does).
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16 * kMmaWarps;
constexpr int kMmaKvTile = 32;  // keys per stage: 4 n-tiles of S, 2 k-steps of P V

template <typename T, int D>
struct MmaPrefillShape {
  static_assert(D % 16 == 0, "head_size must be a multiple of the MMA k (16)");
  static constexpr int kLd = D + 8;              // padded row (T elements): conflict-free fragment loads
  static constexpr int kChunksPerRow = D / 8;    // 16-byte chunks of a K/V row
  static constexpr int kKSteps = D / 16;         // k-steps of S = Q K^T
  static constexpr int kDimTiles = D / 8;        // n-tiles of O
  static constexpr int kKeyTiles = kMmaKvTile / 8;
  static constexpr size_t kQBytes = sizeof(T) * kMmaRows * kLd;
  static constexpr size_t kKvBytes = sizeof(T) * kMmaKvTile * kLd;  // one K or V stage
  static constexpr size_t kSmemBytes = kQBytes + 4 * kKvBytes + sizeof(int) * 2 * kMmaKvTile;
};

// 16 bytes of a query row: one vector load when aligned (the usual case), else eight
// 2-byte loads (query's leading stride is free, so a row may start at any even address).
template <typename T>
__device__ __forceinline__ uint4 load16_any(const T* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) return load16(p);
  uint4 v;
  memcpy(&v, p, 16);
  return v;
}

// Issues the cp.async copies of K/V tile [kv0, kv0 + kMmaKvTile) into one stage; keys
// that are past kv_end or in a block outside the cache are zero-filled and flagged.
template <typename T, int D>
__device__ __forceinline__ void stage_kv_tile(const PrefillParams& p, const int32_t* table, const T* k_base,
                                              const T* v_base, int64_t token_stride, int kv0, int kv_end, T* s_k,
                                              T* s_v, int* s_ok) {
  using Shape = MmaPrefillShape<T, D>;
  for (int i = threadIdx.x; i < kMmaKvTile * Shape::kChunksPerRow; i += kMmaWarps * 32) {
    const int t = i / Shape::kChunksPerRow;
    const int c = i % Shape::kChunksPerRow;
    const int pos = kv0 + t;
    bool ok = pos < kv_end;
    int64_t offset = 0;
    if (ok) {
      const int block = table[pos >> p.log2_block_size];
      ok = block >= 0 && block < p.kv.num_blocks;
      offset = (int64_t(block) * p.kv.block_size + (pos & (p.kv.block_size - 1))) * token_stride + c * 8;
    }
    if (!ok) offset = 0;  // cp.async with 0 source bytes still takes a mapped address
    cp_async16(s_k + t * Shape::kLd + c * 8, k_base + offset, ok);
    cp_async16(s_v + t * Shape::kLd + c * 8, v_base + offset, ok);
    if (c == 0) s_ok[t] = ok;
  }
}

// Where a quantized tile is read from: the kv head's codes and (scale, zero) pairs, or
// fp8's tensor multipliers (kv_cache_vec.cuh).
struct QuantTileSrc {
  const uint8_t* k;  // the kv head's first row
  const uint8_t* v;
  const __half* k_plane;
  const __half* v_plane;
  float k_mul, v_mul;
  int kv_head;
};

// stage_kv_tile for a quantized cache: the codes cannot be copied as they are, so each
// thread loads the 8 codes of a 16-byte chunk (8 or 4 bytes), dequantizes them in fp32
// and stores them rounded to T. Synchronous loads: the next tile's loads still overlap
// the current tile's MMAs of the other warps, but not those of the loading thread.
template <typename T, int D, KVCacheDType F>
__device__ __forceinline__ void stage_kv_tile_quant(const PrefillParams& p, const int32_t* table,
                                                    const QuantTileSrc& src, int64_t token_stride, int kv0,
                                                    int kv_end, T* s_k, T* s_v, int* s_ok) {
  using Shape = MmaPrefillShape<T, D>;
  using KV = KVVec<T, F>;
  using Raw = typename KV::Raw;
  static_assert(KV::kElems == 8, "one 16-byte chunk of T per load");
  for (int i = threadIdx.x; i < kMmaKvTile * Shape::kChunksPerRow; i += kMmaWarps * 32) {
    const int t = i / Shape::kChunksPerRow;
    const int c = i % Shape::kChunksPerRow;
    const int pos = kv0 + t;
    bool ok = pos < kv_end;
    int64_t slot = 0;
    if (ok) {
      const int block = table[pos >> p.log2_block_size];
      ok = block >= 0 && block < p.kv.num_blocks;
      slot = int64_t(block) * p.kv.block_size + (pos & (p.kv.block_size - 1));
    }
    const int64_t offset = slot * token_stride + c * KV::kStored;
    const int64_t row = slot * p.kv.num_kv_heads + src.kv_head;
    const float2 ks = row_scale<F>(src.k_plane, row, src.k_mul, ok);
    const float2 vs = row_scale<F>(src.v_plane, row, src.v_mul, ok);
    float kf[8], vf[8];
    dequant_vec<T, F>(ok ? load_raw<Raw>(src.k + offset) : Raw{}, kf, ks.x, ks.y);
    dequant_vec<T, F>(ok ? load_raw<Raw>(src.v + offset) : Raw{}, vf, vs.x, vs.y);
    *reinterpret_cast<uint4*>(s_k + t * Shape::kLd + c * 8) =
        make_uint4(pack2<T>(kf[0], kf[1]), pack2<T>(kf[2], kf[3]), pack2<T>(kf[4], kf[5]), pack2<T>(kf[6], kf[7]));
    *reinterpret_cast<uint4*>(s_v + t * Shape::kLd + c * 8) =
        make_uint4(pack2<T>(vf[0], vf[1]), pack2<T>(vf[2], vf[3]), pack2<T>(vf[4], vf[5]), pack2<T>(vf[6], vf[7]));
    if (c == 0) s_ok[t] = ok;
  }
}

// One K/V tile into a stage: cp.async for auto, dequantizing loads otherwise.
template <typename T, int D, KVCacheDType F>
__device__ __forceinline__ void stage_tile(const PrefillParams& p, const int32_t* table, const T* k_base,
                                           const T* v_base, const QuantTileSrc& quant, int64_t token_stride, int kv0,
                                           int kv_end, T* s_k, T* s_v, int* s_ok) {
  if constexpr (F == KVCacheDType::kAuto) {
    stage_kv_tile<T, D>(p, table, k_base, v_base, token_stride, kv0, kv_end, s_k, s_v, s_ok);
  } else {
    stage_kv_tile_quant<T, D, F>(p, table, quant, token_stride, kv0, kv_end, s_k, s_v, s_ok);
  }
}

template <typename T, int D, bool kExtras, KVCacheDType F>
__global__ void __launch_bounds__(kMmaWarps * 32) paged_prefill_mma_kernel(const PrefillParams p) {
  using Shape = MmaPrefillShape<T, D>;
  constexpr int kLd = Shape::kLd;
  constexpr int NT = Shape::kDimTiles;
  constexpr int KT = Shape::kKeyTiles;

  extern __shared__ float4 smem_f4[];
  T* s_q = reinterpret_cast<T*>(smem_f4);           // [kMmaRows][kLd]
  T* s_k = s_q + kMmaRows * kLd;                     // [2][kMmaKvTile][kLd]
  T* s_v = s_k + 2 * kMmaKvTile * kLd;               // [2][kMmaKvTile][kLd]
  int* s_ok = reinterpret_cast<int*>(s_v + 2 * kMmaKvTile * kLd);  // [2][kMmaKvTile]

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // fragment row (and row + 8)
  const int t = lane % 4;  // fragment column pair
  const int kv_head = blockIdx.y / p.num_chunks;
  const int chunk = blockIdx.y % p.num_chunks;
  const int seq = blockIdx.z;

  const SeqRange range = clamped_seq_range(p, seq);
  const int q_begin = range.q_begin, q_len = range.q_len, seq_len = range.seq_len;
  const int qt = p.tokens_per_tile;
  const int hc = p.heads_per_chunk;
  const int head0 = kv_head * p.group_size + chunk * hc;
  const int num_q_heads = min(hc, p.group_size - chunk * hc);

  const int32_t* table = p.kv.block_tables + int64_t(seq) * p.kv.max_blocks_per_seq;
  constexpr int kRowElems = D / values_per_element(F);  // cache elements of one kv head's row
  const int64_t token_stride = int64_t(p.kv.num_kv_heads) * kRowElems;
  const T* k_base = static_cast<const T*>(p.kv.key_cache) + int64_t(kv_head) * D;
  const T* v_base = static_cast<const T*>(p.kv.value_cache) + int64_t(kv_head) * D;
  QuantTileSrc quant{};
  if constexpr (F != KVCacheDType::kAuto) {
    quant.k = static_cast<const uint8_t*>(p.kv.key_cache) + int64_t(kv_head) * kRowElems;
    quant.v = static_cast<const uint8_t*>(p.kv.value_cache) + int64_t(kv_head) * kRowElems;
    quant.k_plane = p.kv.k_plane;
    quant.v_plane = p.kv.v_plane;
    quant.k_mul = is_fp8(F) ? fp8_mul(F, p.kv.k_scale) : 1.f;
    quant.v_mul = is_fp8(F) ? fp8_mul(F, p.kv.v_scale) : 1.f;
    quant.kv_head = kv_head;
  }

  // Query tiles are strided over the grid: a q_len above the max_query_len the grid was
  // sized for (index checks off) costs time, never unwritten rows.
  for (int tile_q0 = blockIdx.x * qt; tile_q0 < q_len; tile_q0 += gridDim.x * qt) {
    const QueryTile tile = query_tile(tile_q0, q_len, seq_len, qt, hc, num_q_heads, kExtras ? p.sliding_window : 0);
    const int kv_begin = tile.kv_begin, kv_end = tile.kv_end;

    __syncthreads();  // the previous query tile is done with s_q / s_k / s_v
    if (kv_end > kv_begin) {
      stage_tile<T, D, F>(p, table, k_base, v_base, quant, token_stride, kv_begin, kv_end, s_k, s_v, s_ok);
    }
    cp_async_commit();
    for (int i = threadIdx.x; i < kMmaRows * Shape::kChunksPerRow; i += kMmaWarps * 32) {
      const int r = i / Shape::kChunksPerRow;
      const int c = i % Shape::kChunksPerRow;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (tile.row_pos(r) >= 0) {
        const T* q_row = static_cast<const T*>(p.query) + (q_begin + tile_q0 + r / hc) * p.query_stride +
                         int64_t(head0 + r % hc) * D;
        v = load16_any(q_row + c * 8);
      }
      *reinterpret_cast<uint4*>(s_q + r * kLd + c * 8) = v;
    }

    const int r0 = warp * 16 + g;  // this lane's two rows
    const int pos_r[2] = {tile.row_pos(r0), tile.row_pos(r0 + 8)};
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};  // this lane's partial row sums (the quad is summed at the end)

    const int num_kv_tiles = kv_end > kv_begin ? (kv_end - kv_begin + kMmaKvTile - 1) / kMmaKvTile : 0;
    for (int it = 0; it < num_kv_tiles; ++it) {
      const int stage = it & 1;
      const int kv0 = kv_begin + it * kMmaKvTile;
      if (it + 1 < num_kv_tiles) {
        const int nxt = stage ^ 1;
        stage_tile<T, D, F>(p, table, k_base, v_base, quant, token_stride, kv0 + kMmaKvTile, kv_end,
                            s_k + nxt * kMmaKvTile * kLd, s_v + nxt * kMmaKvTile * kLd, s_ok + nxt * kMmaKvTile);
        cp_async_commit();
        cp_async_wait<1>();  // this tile's group has landed; the next one may still fly
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const T* k_tile = s_k + stage * kMmaKvTile * kLd;
      const T* v_tile = s_v + stage * kMmaKvTile * kLd;
      const int* ok = s_ok + stage * kMmaKvTile;

      // S = Q K^T: 16 rows x kMmaKvTile keys per warp.
      float sc[KT][4];
#pragma unroll
      for (int n = 0; n < KT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < Shape::kKSteps; ++kk) {
        const T* qa = s_q + r0 * kLd + kk * 16 + 2 * t;
        uint32_t a[4];
        a[0] = *reinterpret_cast<const uint32_t*>(qa);
        a[1] = *reinterpret_cast<const uint32_t*>(qa + 8 * kLd);
        a[2] = *reinterpret_cast<const uint32_t*>(qa + 8);
        a[3] = *reinterpret_cast<const uint32_t*>(qa + 8 * kLd + 8);
#pragma unroll
        for (int n = 0; n < KT; ++n) {
          const T* kb = k_tile + (n * 8 + g) * kLd + kk * 16 + 2 * t;
          const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(kb), *reinterpret_cast<const uint32_t*>(kb + 8)};
          mma_m16n8k16<T>(sc[n], a, b);
        }
      }

      // Scale, causal/validity mask, online softmax. Element i of n-tile n is row
      // r0 + 8 * (i >= 2), key kv0 + n * 8 + 2t + (i & 1); a row's keys sit in one lane quad.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < KT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = n * 8 + 2 * t + (i & 1);
          const int qpos = pos_r[i >> 1];
          bool visible = qpos >= 0 && kv0 + key <= qpos && ok[key];
          float score = sc[n][i] * p.scale;
          if constexpr (kExtras) {
            visible = visible && in_window(kv0 + key, qpos, p.sliding_window);
            if (p.soft_cap > 0.f) score = soft_cap_logit(score, p.soft_cap);
          }
          sc[n][i] = visible ? score : -INFINITY;
          tile_max[i >> 1] = fmaxf(tile_max[i >> 1], sc[n][i]);
        }
      }
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = warp_max<1, 4>(tile_max[h]);
        const float m_new = fmaxf(m[h], tile_max[h]);
        alpha[h] = rescale_factor(m[h], m_new);
        m[h] = m_new;
        l[h] *= alpha[h];
      }
#pragma unroll
      for (int n = 0; n < KT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sc[n][i] = exp_shifted(sc[n][i], m[i >> 1]);
          l[i >> 1] += sc[n][i];
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }

      // O += P V: k-step j covers keys 16j..16j+15, i.e. S n-tiles 2j and 2j+1.
#pragma unroll
      for (int j = 0; j < KT / 2; ++j) {
        const uint32_t a[4] = {pack2<T>(sc[2 * j][0], sc[2 * j][1]), pack2<T>(sc[2 * j][2], sc[2 * j][3]),
                               pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]),
                               pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3])};
        const T* vb = v_tile + (j * 16 + 2 * t) * kLd + g;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint32_t b[2] = {pack2_strided(vb + n * 8, kLd), pack2_strided(vb + 8 * kLd + n * 8, kLd)};
          mma_m16n8k16<T>(o[n], a, b);
        }
      }
      __syncthreads();  // the next iteration's cp.async overwrites the stage read here
    }

    // Normalize and store rows r0 and r0 + 8: this lane holds dims n * 8 + 2t, 2t + 1.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const float sum = warp_sum<1, 4>(l[h]);
      if (pos_r[h] < 0) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // 0: every key masked (bad block ids): zeros
      T* o_row = static_cast<T*>(p.out) + (q_begin + tile_q0 + r / hc) * p.out_stride + int64_t(head0 + r % hc) * D;
      // out's leading stride is free (e.g. a slice of a wider buffer): pair stores only when aligned.
      const bool pair_aligned = (reinterpret_cast<uintptr_t>(o_row) & 3) == 0;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        T* dst = o_row + n * 8 + 2 * t;
        if (pair_aligned) {
          *reinterpret_cast<uint32_t*>(dst) = pack2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        } else {
          dst[0] = from_float<T>(o[n][2 * h] * inv);
          dst[1] = from_float<T>(o[n][2 * h + 1] * inv);
        }
      }
    }
  }
}

// Raises a kernel's dynamic shared-memory limit once per (kernel, device), not per
// launch: the attribute is per device, and setting it is not a stream operation, so
// doing it on every call would add a driver call to each launch (and to graph capture).
// The kernel is a template argument, not a function argument: every prefill kernel has
// the same type (void(*)(PrefillParams)), so a function argument would share one `done`
// among all of them and leave the later kernels' limits unset.
template <auto Kernel>
cudaError_t ensure_smem_limit(size_t bytes) {
  static std::array<std::atomic<bool>, 64> done{};
  const auto kernel = Kernel;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < static_cast<int>(done.size());
  if (cached && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess && cached) done[device].store(true, std::memory_order_release);
  return err;
}

// Splits the query heads of a kv head into chunks of at most kRows rows and sizes the grid.
dim3 prefill_grid(PrefillParams& p, int rows, int num_kv_heads, int num_seqs, int max_query_len) {
  // All query heads of a kv head in one CTA when they fit; otherwise even chunks.
  p.num_chunks = (p.group_size + rows - 1) / rows;
  p.heads_per_chunk = (p.group_size + p.num_chunks - 1) / p.num_chunks;
  p.tokens_per_tile = rows / p.heads_per_chunk;
  const int num_tiles = (max_query_len + p.tokens_per_tile - 1) / p.tokens_per_tile;
  return dim3(num_tiles, num_kv_heads * p.num_chunks, num_seqs);
}

template <typename T, int D, bool kExtras, KVCacheDType F>
cudaError_t launch_prefill(PrefillParams p, int num_kv_heads, int num_seqs, int max_query_len, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    using Shape = PrefillShape<D>;
    const dim3 grid = prefill_grid(p, Shape::kRows, num_kv_heads, num_seqs, max_query_len);
    if (grid.x == 0) return cudaSuccess;
    auto kernel = paged_prefill_kernel<T, D, kExtras, F>;
    const cudaError_t err = ensure_smem_limit<paged_prefill_kernel<T, D, kExtras, F>>(Shape::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kPrefillThreads, Shape::kSmemBytes, stream>>>(p);
  } else {
    using Shape = MmaPrefillShape<T, D>;
    const dim3 grid = prefill_grid(p, kMmaRows, num_kv_heads, num_seqs, max_query_len);
    if (grid.x == 0) return cudaSuccess;
    auto kernel = paged_prefill_mma_kernel<T, D, kExtras, F>;
    const cudaError_t err = ensure_smem_limit<paged_prefill_mma_kernel<T, D, kExtras, F>>(Shape::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kMmaWarps * 32, Shape::kSmemBytes, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_paged_prefill_attention(const PrefillArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0 || a.num_tokens == 0 || a.max_query_len <= 0) return cudaSuccess;
  if (a.num_seqs > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  PrefillParams p{};
  p.kv = a.kv;
  p.out = a.out;
  p.query = a.query;
  p.out_stride = a.out_stride;
  p.query_stride = a.query_stride;
  p.query_start_loc = a.query_start_loc;
  p.scale = a.scale;
  p.sliding_window = a.sliding_window;
  p.soft_cap = a.logits_soft_cap;
  p.num_tokens = a.num_tokens;
  p.group_size = a.num_heads / a.kv.num_kv_heads;
  if (a.kv.block_size <= 0 || (a.kv.block_size & (a.kv.block_size - 1)) != 0) return cudaErrorInvalidValue;
  while ((1 << p.log2_block_size) < a.kv.block_size) ++p.log2_block_size;
  return dispatch_dtype(a.dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(a.kv.head_size, [&](auto hs) {
      constexpr int D = decltype(hs)::value;
      return dispatch_format(a.kv.format, [&](auto fmt) {
        constexpr KVCacheDType F = decltype(fmt)::value;
        if (p.sliding_window > 0 || p.soft_cap > 0.f) {
          return launch_prefill<T, D, true, F>(p, a.kv.num_kv_heads, a.num_seqs, a.max_query_len, stream);
        }
        return launch_prefill<T, D, false, F>(p, a.kv.num_kv_heads, a.num_seqs, a.max_query_len, stream);
      });
    });
  });
}

}  // namespace pagedkv::cuda
