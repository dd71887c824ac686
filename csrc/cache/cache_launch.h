// Launchers of the CUDA cache kernels. Plain types only (no torch headers); the
// tensor handling lives in csrc/cuda/cache_cuda.cpp. Each returns
// cudaGetLastError() after its launch (cudaSuccess when there was nothing to do).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention/attention_launch.h"  // DType
#include "common/kv_cache_dtype.h"

namespace pagedkv::cuda {

// How a cache write stores the new K/V rows (common/kv_cache_dtype.h). auto: a byte copy.
// fp8: k_scale / v_scale device floats [1] (nullptr: 1.0), read by the kernel (no host
// sync; graph-capturable). Per-token-head: the (scale, zero) planes the kernel fills.
struct KVQuantArgs {
  KVCacheDType format = KVCacheDType::kAuto;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  __half* k_plane = nullptr;  // [num_blocks, block_size, num_kv_heads, 2]
  __half* v_plane = nullptr;
};

struct ReshapeAndCacheArgs {
  const void* key;    // [num_tokens, num_kv_heads, head_size], strides in elements below
  const void* value;
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, X], contiguous (X: as in PagedKV)
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens], negative = skip
  int64_t num_tokens;
  int64_t num_slots;  // num_blocks * block_size: slots at or past it are skipped
  int num_kv_heads;
  int head_size;
  int element_size;   // auto: 2 or 4 bytes (the copy unit); quantized formats ignore it
  DType dtype = DType::kFloat32;  // of key/value: what a quantized format converts from
  KVQuantArgs quant;
};

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

// Copies block src -> dst in every layer's key and value cache, one launch.
// layer_ptrs: device array of 2 * num_layers base pointers (keys, then values) of tensors
// indexed by block id, 16-byte aligned: the caches, or the per-token-head scale planes
// (a second launch). block_bytes: any size; the copy unit is the largest of 16/8/4/2/1
// bytes that divides it. block_mapping: device int64 [num_pairs, 2].
cudaError_t launch_copy_blocks(const int64_t* layer_ptrs, int num_layers, const int64_t* block_mapping,
                               int64_t num_pairs, int64_t block_bytes, int64_t num_blocks, cudaStream_t stream);

}  // namespace pagedkv::cuda
