// Launchers of the CUDA attention kernels. Plain types only (no torch headers):
// the .cu files stay free of ATen, which keeps nvcc's front-end time low, and
// csrc/cuda/attention_cuda.cpp does the tensor handling and validation.
//
// Every launcher enqueues on `stream` and returns cudaGetLastError() after the
// launch (cudaSuccess when there was nothing to launch).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/kv_cache_dtype.h"

namespace pagedkv::cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The paged KV cache of one layer and the block tables that index it.
struct PagedKV {
  // [num_blocks, block_size, num_kv_heads, X], contiguous, 16-byte aligned; X = head_size, or
  // head_size / 2 for int4 (common/kv_cache_dtype.h has the formats).
  const void* key_cache;
  const void* value_cache;  // same shape
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;      // [num_seqs]
  int num_blocks;
  int block_size;
  int num_kv_heads;
  int head_size;  // logical (values per row), whatever the format
  int max_blocks_per_seq;
  // How the cache stores K/V. fp8: k_scale / v_scale are device floats [1] (nullptr: 1.0),
  // read by the kernels, so a launch needs no host sync and can be captured in a graph.
  // Per-token-head: k_plane / v_plane [num_blocks, block_size, num_kv_heads, 2] (scale, zero).
  KVCacheDType format = KVCacheDType::kAuto;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  const __half* k_plane = nullptr;
  const __half* v_plane = nullptr;
};

// Decode (one query token per sequence). out/query rows: token t, head h starts at
// t * stride + h * head_size (elements).
struct DecodeArgs {
  PagedKV kv;
  void* out;
  const void* query;
  int64_t out_stride;
  int64_t query_stride;
  const float* alibi_slopes;  // [num_heads] or nullptr
  float scale;
  int num_seqs;
  int num_heads;
  DType dtype;
  // Query at position p attends to keys [window_first_key(p, sliding_window), p]
  // (common/window.h); 0: no window. logits_soft_cap > 0: scores s -> cap * tanh(s / cap).
  int sliding_window = 0;
  float logits_soft_cap = 0.f;
};

// v2 scratch: exp_sums/max_logits fp32 [num_seqs, num_heads, max_partitions],
// tmp_out [num_seqs, num_heads, max_partitions, head_size] in the query dtype.
struct DecodeScratch {
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  int max_partitions;  // size of the partition dim of the scratch tensors
  int partition_size;  // 256, 512 or 1024
};

cudaError_t launch_paged_attention_v1(const DecodeArgs& args, cudaStream_t stream);

cudaError_t launch_paged_attention_v2(const DecodeArgs& args, const DecodeScratch& scratch, int max_seq_len,
                                      cudaStream_t stream);

// Prefill: query/out [num_tokens, num_heads, head_size]; sequence s owns tokens
// query_start_loc[s] .. query_start_loc[s+1]-1.
struct PrefillArgs {
  PagedKV kv;
  void* out;
  const void* query;
  int64_t out_stride;
  int64_t query_stride;
  const int32_t* query_start_loc;  // [num_seqs + 1]
  float scale;
  int num_seqs;
  int num_heads;
  int num_tokens;
  int max_query_len;
  DType dtype;
  int sliding_window = 0;       // as in DecodeArgs
  float logits_soft_cap = 0.f;  // as in DecodeArgs
};

cudaError_t launch_paged_prefill_attention(const PrefillArgs& args, cudaStream_t stream);

// Largest grid dimension y/z a launcher may use (num_seqs, partitions).
inline constexpr int kMaxGridYZ = 65535;

}  // namespace pagedkv::cuda
