// Prefill PagedAttention on CUDA: several new tokens per sequence, causal over
// the whole paged context (prompt prefill, chunked prefill, prefix-cache hits).
//
// One CTA = (tile of query tokens, kv head [, chunk of its query heads], sequence).
// Its "rows" are (query token, query head) pairs: all G query heads that share
// the kv head, times as many query tokens as fit in kRows, so each K/V tile is
// loaded once from the cache and used by every row. K/V tiles of kKvTile tokens
// are converted to fp32 in shared memory; S = Q K^T, an online softmax per row
// (running max / sum in shared memory) and O += P V follow, with the causal
// mask key_pos <= query_pos. Instantiated for dtype x head_size (18 kernels, see
// paged_attention.cu for the set); block_size is a runtime value.
#include "attention/attention_launch.h"
#include "attention/attention_utils.cuh"

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
};

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

template <typename T, int D>
__global__ void __launch_bounds__(kPrefillThreads) paged_prefill_kernel(const PrefillParams p) {
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
  const int tile = blockIdx.x;
  const int kv_head = blockIdx.y / p.num_chunks;
  const int chunk = blockIdx.y % p.num_chunks;
  const int seq = blockIdx.z;

  // Clamped so that no index leaves query/out or the block-table row, whatever the inputs hold.
  const int q_begin = min(max(p.query_start_loc[seq], 0), p.num_tokens);
  const int q_end = min(max(p.query_start_loc[seq + 1], q_begin), p.num_tokens);
  const int q_len = q_end - q_begin;
  const int seq_len = max(0, min(p.kv.seq_lens[seq], p.kv.max_blocks_per_seq * p.kv.block_size));
  const int qt = p.tokens_per_tile;
  const int hc = p.heads_per_chunk;
  const int tile_q0 = tile * qt;
  if (tile_q0 >= q_len) return;
  const int head0 = kv_head * p.group_size + chunk * hc;
  const int num_q_heads = min(hc, p.group_size - chunk * hc);
  const int ctx_len = seq_len - q_len;  // position of the first new token
  const int last_q = min(tile_q0 + qt, q_len) - 1;
  const int kv_end = max(0, min(seq_len, ctx_len + last_q + 1));  // keys visible to some row

  // Row r = (query token tile_q0 + r / hc, head head0 + r % hc); -1 = not a row.
  auto row_pos = [&](int r) -> int {
    const int qi = r / hc;
    if (qi >= qt || r % hc >= num_q_heads || tile_q0 + qi >= q_len) return -1;
    return max(-1, ctx_len + tile_q0 + qi);
  };

  for (int i = tid; i < kRows * D; i += kPrefillThreads) {
    const int r = i / D;
    const int d = i % D;
    float x = 0.f;
    if (row_pos(r) >= 0) {
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
  const int64_t token_stride = int64_t(p.kv.num_kv_heads) * D;
  const T* k_base = static_cast<const T*>(p.kv.key_cache) + int64_t(kv_head) * D;
  const T* v_base = static_cast<const T*>(p.kv.value_cache) + int64_t(kv_head) * D;

  // O += P V ownership: rows rg + i * kRG (i < 4), float4 columns dg + j * kDimThreads.
  const int rg = tid / Shape::kDimThreads;
  const int dg = tid % Shape::kDimThreads;
  float4 acc[4][Shape::kColsPerThread];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < Shape::kColsPerThread; ++j) acc[i][j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  for (int kv0 = 0; kv0 < kv_end; kv0 += kKvTile) {
    // 1. Stage the K/V tile in fp32 (16-byte loads; unreadable keys become zeros, masked below).
    for (int i = tid; i < kKvTile * VPR; i += kPrefillThreads) {
      const int t = i / VPR;
      const int c = i % VPR;
      const int pos = kv0 + t;
      bool ok = pos < kv_end;
      int64_t offset = 0;
      if (ok) {
        const int block = table[pos / p.kv.block_size];
        ok = block >= 0 && block < p.kv.num_blocks;
        offset = (int64_t(block) * p.kv.block_size + pos % p.kv.block_size) * token_stride + c * VEC;
      }
      const uint4 k_raw = ok ? load16(k_base + offset) : make_uint4(0, 0, 0, 0);
      const uint4 v_raw = ok ? load16(v_base + offset) : make_uint4(0, 0, 0, 0);
      float kf[VEC];
      float vf[VEC];
      unpack(k_raw, kf, T{});
      unpack(v_raw, vf, T{});
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
        const int qpos = row_pos(r);
#pragma unroll
        for (int j = 0; j < kKT; ++j) {
          const int t = itg + kKG * j;
          const bool visible = qpos >= 0 && kv0 + t <= qpos && s_ok[t];
          s_p[r * kSLd + t] = visible ? s[i][j] : -INFINITY;
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
    if (row_pos(r) < 0) continue;
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

template <typename T, int D>
cudaError_t launch_prefill(PrefillParams p, int num_kv_heads, int num_seqs, int max_query_len, cudaStream_t stream) {
  using Shape = PrefillShape<D>;
  constexpr int kRows = Shape::kRows;
  // All query heads of a kv head in one CTA when they fit; otherwise even chunks.
  p.num_chunks = (p.group_size + kRows - 1) / kRows;
  p.heads_per_chunk = (p.group_size + p.num_chunks - 1) / p.num_chunks;
  p.tokens_per_tile = kRows / p.heads_per_chunk;
  const int num_tiles = (max_query_len + p.tokens_per_tile - 1) / p.tokens_per_tile;
  if (num_tiles == 0) return cudaSuccess;
  auto kernel = paged_prefill_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Shape::kSmemBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(num_tiles, num_kv_heads * p.num_chunks, num_seqs);
  kernel<<<grid, kPrefillThreads, Shape::kSmemBytes, stream>>>(p);
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
  p.num_tokens = a.num_tokens;
  p.group_size = a.num_heads / a.kv.num_kv_heads;
  return dispatch_dtype(a.dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(a.kv.head_size, [&](auto hs) {
      return launch_prefill<T, decltype(hs)::value>(p, a.kv.num_kv_heads, a.num_seqs, a.max_query_len, stream);
    });
  });
}

}  // namespace pagedkv::cuda
