// Launchers of the CUDA cache kernels. Plain types only (no torch headers); the
// tensor handling lives in csrc/cuda/cache_cuda.cpp. Each returns
// cudaGetLastError() after its launch (cudaSuccess when there was nothing to do).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedkv::cuda {

struct ReshapeAndCacheArgs {
  const void* key;    // [num_tokens, num_kv_heads, head_size], strides in elements below
  const void* value;
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_size], contiguous
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens], negative = skip
  int64_t num_tokens;
  int64_t num_slots;  // num_blocks * block_size: slots at or past it are skipped
  int num_kv_heads;
  int head_size;
  int element_size;   // 2 or 4 bytes
};

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

// Copies block src -> dst in every layer's key and value cache, one launch.
// layer_ptrs: device array of 2 * num_layers cache base pointers (keys, then values).
// block_mapping: device int64 [num_pairs, 2].
cudaError_t launch_copy_blocks(const int64_t* layer_ptrs, int num_layers, const int64_t* block_mapping,
                               int64_t num_pairs, int64_t block_bytes, int64_t num_blocks, cudaStream_t stream);

}  // namespace pagedkv::cuda
