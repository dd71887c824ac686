// CPU attention kernels: raw-pointer parameter blocks and the per-capability
// entry points. attention_kernels.cpp is compiled once per instruction set
// (namespaces DEFAULT, AVX2, AVX512 and AVX512_BF16, the last for bf16 inputs only,
// named after the CPU_CAPABILITY macro the way ATen names its own kernel
// variants); csrc/cpu/attention.cpp validates the
// tensors, fills these structs and calls the variant picked by cpu_capability.h.
//
// Kept free of at::Tensor so the kernel translation units include only
// ATen's vector headers.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "common/kv_cache_dtype.h"

namespace pagedkv::cpu {

// What every attention kernel reads: the query/out rows and the paged cache.
// Element strides; query/out rows are [num_heads, head_size] dense.
struct PagedAttentionParams {
  c10::ScalarType dtype;
  void* out;
  int64_t out_stride;  // elements between consecutive rows (sequences or tokens) of out
  const void* query;
  int64_t query_stride;
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* seq_lens;      // [num_seqs]; prefill: new tokens included
  float scale;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  // A query at position p attends to keys [window_first_key(p, sliding_window), p]
  // (common/validation.h); 0: no window. Blocks wholly before that are never read.
  int64_t sliding_window = 0;
  float logits_soft_cap = 0.f;  // > 0: scores s become cap * tanh(s / cap), before ALiBi
  // A quantized cache (common/kv_cache_dtype.h): key_cache/value_cache then hold codes
  // (int4: head_size / 2 bytes a row); dtype stays the query's.
  KVCacheDType kv_format = KVCacheDType::kAuto;
  float k_scale = 1.f, v_scale = 1.f;        // fp8: the per-tensor scales
  const c10::Half* k_plane = nullptr;        // per-token-head: [num_blocks, block_size, num_kv_heads, 2]
  const c10::Half* v_plane = nullptr;
};

// Decode (v1 and v2): one query row per sequence.
struct DecodeParams : PagedAttentionParams {
  const float* alibi_slopes = nullptr;  // [num_heads] or nullptr
  // avx512_bf16 decode: Q.K^T on vdpbf16ps where true, on fp32 FMAs where false (bf16 caches at
  // head sizes that are multiples of 32, fp8 at multiples of 64; cpu_bf16_dot_enabled: which is
  // faster differs by CPU), and int8 P.V on paired codes from kMinPairedHeadSize (always where false).
  bool bf16_dot = true;
  // v2 only: partition_size == 0 means v1 (one pass over each sequence, result in out).
  int64_t partition_size = 0;
  int64_t max_partitions = 0;  // size(2) of exp_sums / max_logits / tmp_out
  float* exp_sums = nullptr;    // [num_seqs, num_heads, max_partitions]
  float* max_logits = nullptr;  // [num_seqs, num_heads, max_partitions]
  void* tmp_out = nullptr;      // [num_seqs, num_heads, max_partitions, head_size], query dtype
};

// Prefill / chunked prefill: several new tokens per sequence, causal.
struct PrefillParams : PagedAttentionParams {
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  // bf16 in the AVX512_BF16 variant: both products on AMX tiles (attention_amx.cpp), a
  // quantized cache's rows rounded to bf16 for them. Set where cpu_amx_enabled(); the other
  // variants ignore it.
  bool use_amx = false;
};

// One set of entry points per capability. decode_attention runs v1 (partition_size
// 0) or the per-partition pass of v2; reduce_partitions is v2's second pass.
#define PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS(capability) \
  namespace capability {                                 \
  void decode_attention(const DecodeParams& params);     \
  void reduce_partitions(const DecodeParams& params);    \
  void prefill_attention(const PrefillParams& params);   \
  }

PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS(DEFAULT)
PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS(AVX2)
PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS(AVX512)
PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS(AVX512_BF16)

#undef PAGEDKV_DECLARE_CPU_ATTENTION_KERNELS

// Keys per step of the AMX prefill: two P.V tile products (32 keys each) per load and store of
// the sums, against one with 32 keys.
constexpr int kAmxKeyTile = 64;

// Prefill on AMX tiles (attention_amx.cpp, AVX512_BF16 only): one task's query rows
// (token x head of the group) in row vectors of 16, rp rows in all.
struct AmxPrefillState {
  int64_t D, dp, rp;        // head size; D rounded up to 32 (a tile of dims); rows rounded up to 16
  uint32_t* qt;             // [dp / 2][rp] dwords: (q_r[2j], q_r[2j + 1]) in bf16, zeros past D
  float* ot;                // [D][rp] unnormalized output, transposed
  float* scores;            // [kAmxKeyTile][rp]
  uint32_t* pairs;          // [kAmxKeyTile / 2][rp] probabilities in bf16 pairs of keys
  float *m, *l;             // [rp] running max and sum
  const float* qpos;        // [rp] each row's position (padding rows: the last row's)
  float scale, soft_cap;    // soft_cap 0: off
  int64_t window;           // 0: none
};

// One key tile of the task: keys [k0, k0 + n), n <= kAmxKeyTile.
struct AmxKeyTile {
  const c10::BFloat16* keys;  // [kAmxKeyTile][dp] K rows, zeros past D (rows from n are never used)
  const c10::BFloat16* vt;    // [D][kAmxKeyTile] V transposed, zero columns from n
  int64_t k0;
  int n;
  bool first;                 // the task's first key tile (nothing to rescale yet)
  bool causal_mask;           // some key is after some row's position
  bool window_mask;           // some key is before some row's window
};

namespace AVX512_BF16 {
// The time of one vdpbf16ps (32 bf16 products) over that of one fp32 FMA (16 products), both
// at full throughput, measured on this core: about 1 on AMD Zen 4, 4 on Intel Sapphire Rapids.
double bf16_dot_cost();
// Load the tile configuration on this thread / release the tile state.
void amx_tiles_begin();
void amx_tiles_end();
// The query rows of row vector v (rows[i]: row 16 v + i, null for padding) into qt: dword
// [j][16 v + i] = (rows[i][2j], rows[i][2j + 1]) for j < dp / 2, zeros past D.
void amx_pack_query(const c10::BFloat16* const* rows, int64_t D, int64_t dp, uint32_t* qt, int64_t rp, int64_t v);
// vt[d][t] = rows[t][d] for kAmxKeyTile value rows (a null row: zeros); vt: [D][kAmxKeyTile], D a multiple of 16.
void amx_pack_values(const c10::BFloat16* const* rows, int64_t D, c10::BFloat16* vt);
// Row vectors [v_begin, v_end) through one key tile: scores = Q.K^T on tiles, the online-softmax
// step, ot += V^T.P^T on tiles.
void amx_prefill_step(const AmxPrefillState& st, const AmxKeyTile& kt, int64_t v_begin, int64_t v_end);
// rows[i][d] = ot[d][16 v + i] * inv[i] in bf16 for the rows of row vector v (null rows skipped).
void amx_store_rows(const float* ot, int64_t D, int64_t rp, int64_t v, const float* inv, c10::BFloat16* const* rows);
}  // namespace AVX512_BF16

}  // namespace pagedkv::cpu
