// Device helpers shared by the decode and prefill attention kernels: 16-byte
// vector loads of K/V rows converted to fp32, scalar conversions, warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/attention_launch.h"

namespace pagedkv::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);  // elements in one 16-byte load
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Unpacks 16 bytes holding Vec16<T>::kElems values into fp32.
__device__ __forceinline__ void unpack(const uint4& u, float (&f)[4], float) {
  f[0] = __uint_as_float(u.x);
  f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z);
  f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4& u, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void unpack(const uint4& u, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// Sum / max over the lanes whose ids differ only in the bits of [LO, HI)
// (LO, HI powers of two). Every lane of the warp must call it.
template <int LO, int HI>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = LO; o < HI; o *= 2) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
template <int LO, int HI>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = LO; o < HI; o *= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// exp(x - m) for a softmax with running max m; 0 when x is masked (-inf).
__device__ __forceinline__ float exp_shifted(float x, float m) { return x == -INFINITY ? 0.f : __expf(x - m); }

// Rescale factor exp(m_old - m_new) of an online softmax; m_old = -inf (nothing
// accumulated yet) gives 0, m_new = -inf (still nothing) gives 1.
__device__ __forceinline__ float rescale_factor(float m_old, float m_new) {
  if (m_new == -INFINITY) return 1.f;
  return m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
}

constexpr int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// Dispatches a functor on the dtype: f(T{}) with T the kernel element type.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

template <int D>
struct HeadSize {
  static constexpr int value = D;
};

// Dispatches on the head size: f(HeadSize<D>{}). The set is the one of
// csrc/common/supported.h; anything else was rejected by the host validation.
template <typename F>
cudaError_t dispatch_head_size(int head_size, F&& f) {
  switch (head_size) {
    case 64:
      return f(HeadSize<64>{});
    case 80:
      return f(HeadSize<80>{});
    case 96:
      return f(HeadSize<96>{});
    case 112:
      return f(HeadSize<112>{});
    case 128:
      return f(HeadSize<128>{});
    case 256:
      return f(HeadSize<256>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedkv::cuda
