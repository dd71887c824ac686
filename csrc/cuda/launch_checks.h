// What every CUDA op's host side shares: the kernels' dtype from a tensor's, and the
// check after a launch. Plain inline helpers for csrc/cuda/*.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "attention/attention_launch.h"  // DType
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

// The cache formats the CUDA kernels read and write.
inline void check_cuda_kv_format(const char* op, const KVCacheArgs& kv) {
  TORCH_CHECK(kv.dims.format == KVCacheDType::kAuto, op,
              ": a quantized kv_cache_dtype has no CUDA kernel in this build (CPU only)");
}

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace pagedkv::cuda
