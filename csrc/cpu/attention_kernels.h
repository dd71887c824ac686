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

}  // namespace pagedkv::cpu
