// Block-copy kernels on CUDA: write new tokens' K/V into their cache slots, and
// copy whole blocks within every layer's cache (copy-on-write) in one launch.
// They move bytes, so they are templated on the copy unit (16-byte vectors when
// the layout allows, else 2- or 4-byte elements), not on the dtype. A quantized
// kv_cache_dtype has its own writer (one warp per (token, kv head) row, cache/kv_quant.cuh),
// templated on the key/value dtype only: the format is a run-time switch per row, the
// kernel being far from any register or time budget (3 instantiations).
// copy_blocks moves the scale planes of the per-token-head formats with a second launch;
// its copy unit is the largest of 16/8/4/2/1 bytes dividing the block's bytes (1-byte
// caches and [.., 2] fp16 planes of small blocks included).
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_utils.cuh"
#include "cache/cache_launch.h"
#include "cache/kv_quant.cuh"

namespace pagedkv::cuda {
namespace {

constexpr int kCacheThreads = 128;

// One CTA per token: copies its [num_kv_heads, head_size] key and value rows
// (strided source) into the contiguous cache slot. Strides are in Unit elements.
template <typename Unit>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache_kernel(const ReshapeAndCacheArgs a, int units_per_head, int64_t k_tok, int64_t k_head,
                             int64_t v_tok, int64_t v_head) {
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an id the host check would have refused)
  const int units_per_token = a.num_kv_heads * units_per_head;
  const Unit* key = static_cast<const Unit*>(a.key) + token * k_tok;
  const Unit* value = static_cast<const Unit*>(a.value) + token * v_tok;
  Unit* key_dst = static_cast<Unit*>(a.key_cache) + slot * units_per_token;
  Unit* value_dst = static_cast<Unit*>(a.value_cache) + slot * units_per_token;
  for (int i = threadIdx.x; i < units_per_token; i += kCacheThreads) {
    const int head = i / units_per_head;
    const int u = i % units_per_head;
    key_dst[i] = key[head * k_head + u];
    value_dst[i] = value[head * v_head + u];
  }
}

// One CTA per token, one warp per (K or V, kv head) row: quantizes the token's rows
// (strides in elements of T) into its slot of a quantized cache.
template <typename T>
__global__ void __launch_bounds__(kCacheThreads) reshape_and_cache_quant_kernel(const ReshapeAndCacheArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an id the host check would have refused)
  const T* key = static_cast<const T*>(a.key) + token * a.key_stride_token;
  const T* value = static_cast<const T*>(a.value) + token * a.value_stride_token;
  quantize_token(a.quant, key, a.key_stride_head, value, a.value_stride_head, a.key_cache, a.value_cache, slot,
                 a.num_kv_heads, a.head_size, threadIdx.x / 32, kCacheThreads / 32, threadIdx.x % 32);
}

// grid (num_pairs, num_layers): copies block src -> dst of one layer's key and value cache
// (or scale planes), in Unit-sized pieces. Pairs run concurrently: a block that is the
// destination of one pair must not be the source of another (copy-on-write mappings copy
// shared blocks into fresh ones).
template <typename Unit>
__global__ void __launch_bounds__(kCacheThreads)
    copy_blocks_kernel(const int64_t* layer_ptrs, int num_layers, const int64_t* block_mapping,
                       int64_t vecs_per_block, int64_t num_blocks) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    Unit* base = reinterpret_cast<Unit*>(layer_ptrs[kv * num_layers + layer]);
    const Unit* from = base + src * vecs_per_block;
    Unit* to = base + dst * vecs_per_block;
    for (int64_t i = threadIdx.x; i < vecs_per_block; i += kCacheThreads) to[i] = from[i];
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename Unit>
cudaError_t launch_reshape(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const int64_t per_unit = sizeof(Unit) / a.element_size;  // elements per copy unit
  reshape_and_cache_kernel<Unit><<<static_cast<unsigned>(a.num_tokens), kCacheThreads, 0, stream>>>(
      a, static_cast<int>(a.head_size / per_unit), a.key_stride_token / per_unit, a.key_stride_head / per_unit,
      a.value_stride_token / per_unit, a.value_stride_head / per_unit);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t launch_copy(const int64_t* layer_ptrs, int num_layers, const int64_t* block_mapping, int64_t num_pairs,
                        int64_t block_bytes, int64_t num_blocks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), num_layers);
  copy_blocks_kernel<Unit><<<grid, kCacheThreads, 0, stream>>>(layer_ptrs, num_layers, block_mapping,
                                                               block_bytes / int64_t(sizeof(Unit)), num_blocks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (a.quant.format != KVCacheDType::kAuto) {
    return dispatch_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      reshape_and_cache_quant_kernel<T><<<static_cast<unsigned>(a.num_tokens), kCacheThreads, 0, stream>>>(a);
      return cudaGetLastError();
    });
  }
  // 16-byte units when every row start of source and destination is 16-byte aligned.
  const int64_t vec = 16 / a.element_size;
  const bool vectorizable = a.head_size % vec == 0 && a.key_stride_token % vec == 0 &&
                            a.key_stride_head % vec == 0 && a.value_stride_token % vec == 0 &&
                            a.value_stride_head % vec == 0 && aligned(a.key, 16) && aligned(a.value, 16) &&
                            aligned(a.key_cache, 16) && aligned(a.value_cache, 16);
  if (vectorizable) return launch_reshape<uint4>(a, stream);
  if (a.element_size == 4) return launch_reshape<uint32_t>(a, stream);
  if (a.element_size == 2) return launch_reshape<uint16_t>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_blocks(const int64_t* layer_ptrs, int num_layers, const int64_t* block_mapping,
                               int64_t num_pairs, int64_t block_bytes, int64_t num_blocks, cudaStream_t stream) {
  if (num_pairs == 0 || num_layers == 0) return cudaSuccess;
  if (block_bytes <= 0 || num_layers > 65535 || num_pairs > 0x7fffffffLL) return cudaErrorInvalidValue;
  // Base pointers are 16-byte aligned (the host checks), so block starts are aligned to
  // any unit that divides block_bytes.
  auto copy = [&](auto unit) {
    return launch_copy<decltype(unit)>(layer_ptrs, num_layers, block_mapping, num_pairs, block_bytes, num_blocks,
                                       stream);
  };
  if (block_bytes % 16 == 0) return copy(uint4{});
  if (block_bytes % 8 == 0) return copy(uint2{});
  if (block_bytes % 4 == 0) return copy(uint32_t{});
  if (block_bytes % 2 == 0) return copy(uint16_t{});
  return copy(uint8_t{});
}

}  // namespace pagedkv::cuda
