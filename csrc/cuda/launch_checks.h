// What every CUDA op's host side shares: the kernels' dtype from a tensor's, the cache
// format's scale pointers, and the check after a launch. Plain inline helpers for
// csrc/cuda/*.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "attention/attention_launch.h"  // DType, PagedKV
#include "cache/cache_launch.h"          // KVQuantArgs
#include "common/validation.h"

namespace pagedkv::cuda {

inline DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "pagedkv: unsupported dtype ", t);
  }
}

// A validated scale tensor (check_kv_cache_args) as the kernels take it: fp8's device
// float [1] or a per-token-head fp16 plane; nullptr when absent (fp8: 1.0).
template <typename P>
P* scale_ptr(const at::Tensor& t) {
  return t.defined() ? static_cast<P*>(t.data_ptr()) : nullptr;
}

// How a cache write stores K/V: the format and its scales (pointers only: no host sync).
inline KVQuantArgs quant_args(const KVCacheArgs& kv) {
  KVQuantArgs q;
  q.format = kv.dims.format;
  if (is_fp8(q.format)) {
    q.k_scale = scale_ptr<const float>(kv.k_scale);
    q.v_scale = scale_ptr<const float>(kv.v_scale);
  } else if (is_per_token_head(q.format)) {
    q.k_plane = scale_ptr<__half>(kv.k_scale);
    q.v_plane = scale_ptr<__half>(kv.v_scale);
  }
  return q;
}

// The same for a cache read: fills the format fields of kv.
inline void set_kv_format(PagedKV& kv, const KVCacheArgs& args) {
  const KVQuantArgs q = quant_args(args);
  kv.format = q.format;
  kv.k_scale = q.k_scale;
  kv.v_scale = q.v_scale;
  kv.k_plane = q.k_plane;
  kv.v_plane = q.v_plane;
}

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace pagedkv::cuda
