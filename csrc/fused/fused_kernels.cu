// Fused per-layer CUDA kernels: RMSNorm (optionally adding the residual first), RoPE
// with the KV-cache write, and the MLP's gated activation. One CTA per token, fp32
// arithmetic, one rounding to the storage dtype per stored value (the rounding points
// of csrc/cpu/fused_kernels.cpp).
// Element-wise loads, coalesced across the CTA: these kernels move a few KiB per token
// and sit far below the cost of the GEMMs around them. A quantized cache gets the rotated
// key and the value through the writer of reshape_and_cache (cache/kv_quant.cuh, one warp
// per row), so both ops store the same codes for the same rows.
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_utils.cuh"
#include "cache/kv_quant.cuh"
#include "fused/fused_launch.h"

namespace pagedkv::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRotaryThreads = 128;
constexpr int kActThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const RmsNormArgs a) {
  const int64_t t = blockIdx.x;
  const T* x = static_cast<const T*>(a.input) + t * a.input_stride;
  T* r = a.residual != nullptr ? static_cast<T*>(a.residual) + t * a.residual_stride : nullptr;
  T* out = static_cast<T*>(a.out) + t * a.out_stride;
  const T* w = static_cast<const T*>(a.weight);
  float sumsq = 0.f;
  for (int i = threadIdx.x; i < a.hidden_size; i += kNormThreads) {
    float z = to_float(x[i]);
    if (r != nullptr) {
      const T stored = from_float<T>(z + to_float(r[i]));
      r[i] = stored;
      z = to_float(stored);  // the sum of squares is of the residual as stored
    }
    sumsq += z * z;
  }
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float inv_rms;
  sumsq = warp_sum<1, 32>(sumsq);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sumsq;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < kNormThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
    v = warp_sum<1, 32>(v);
    if (threadIdx.x == 0) inv_rms = 1.f / sqrtf(v / static_cast<float>(a.hidden_size) + a.epsilon);
  }
  __syncthreads();
  const float scale = inv_rms;
  // Each thread reads back only the elements it wrote above, so out may alias input.
  const T* z = r != nullptr ? r : x;
  for (int i = threadIdx.x; i < a.hidden_size; i += kNormThreads) {
    const float normed = to_float(from_float<T>(to_float(z[i]) * scale));  // 16-bit: HF's rounding order
    out[i] = from_float<T>(normed * to_float(w[i]));
  }
}

// Pair j of a head: (j, j + half) rotate-half (NeoX), (2j, 2j + 1) GPT-J.
template <typename T, bool kNeox>
__device__ __forceinline__ void rotate_pair(T* x, int j, int half, float c, float s) {
  const int i0 = kNeox ? j : 2 * j;
  const int i1 = kNeox ? j + half : 2 * j + 1;
  const float x0 = to_float(x[i0]), x1 = to_float(x[i1]);
  x[i0] = from_float<T>(x0 * c - x1 * s);
  x[i1] = from_float<T>(x1 * c + x0 * s);
}

template <typename T, bool kNeox>
__global__ void __launch_bounds__(kRotaryThreads) rotary_cache_kernel(const RotaryCacheArgs a) {
  const int64_t t = blockIdx.x;
  const int64_t pos = a.positions[t];
  const int half = a.rot_dim / 2;
  T* q = static_cast<T*>(a.query) + t * a.query_stride_token;
  T* k = static_cast<T*>(a.key) + t * a.key_stride_token;
  if (pos >= 0 && pos < a.max_position) {
    const float* cos = a.cos_sin_cache + pos * a.rot_dim;
    const float* sin = cos + half;
    const int q_pairs = a.num_heads * half;
    const int pairs = (a.num_heads + a.num_kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += kRotaryThreads) {
      const bool is_query = i < q_pairs;
      const int p = is_query ? i : i - q_pairs;
      const int head = p / half, j = p % half;
      T* x = is_query ? q + head * a.query_stride_head : k + head * a.key_stride_head;
      rotate_pair<T, kNeox>(x, j, half, cos[j], sin[j]);
    }
  }
  __syncthreads();  // the rotated key rows are read back by other threads below
  const int64_t slot = a.slot_mapping[t];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an id the host check would have refused)
  const T* v = static_cast<const T*>(a.value) + t * a.value_stride_token;
  if (a.quant.format != KVCacheDType::kAuto) {
    return quantize_token(a.quant, static_cast<const T*>(k), a.key_stride_head, v, a.value_stride_head, a.key_cache,
                          a.value_cache, slot, a.num_kv_heads, a.head_size, threadIdx.x / 32, kRotaryThreads / 32,
                          threadIdx.x % 32);
  }
  const int row = a.num_kv_heads * a.head_size;
  T* key_dst = static_cast<T*>(a.key_cache) + slot * row;
  T* value_dst = static_cast<T*>(a.value_cache) + slot * row;
  for (int i = threadIdx.x; i < row; i += kRotaryThreads) {
    const int head = i / a.head_size, d = i % a.head_size;
    key_dst[i] = k[head * a.key_stride_head + d];
    value_dst[i] = v[head * a.value_stride_head + d];
  }
}

template <GatedActivation A>
__device__ __forceinline__ float activate(float x) {
  if constexpr (A == GatedActivation::kSilu) {
    return x / (1.f + expf(-x));
  } else if constexpr (A == GatedActivation::kGelu) {
    return x * 0.5f * (1.f + erff(x * static_cast<float>(M_SQRT1_2)));
  } else {
    const float inner = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5) * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.f + tanhf(inner));
  }
}

// One CTA per token; act(gate) is rounded to T before the product (the CPU kernels' rounding point).
template <typename T, GatedActivation A>
__global__ void __launch_bounds__(kActThreads) act_and_mul_kernel(const ActAndMulArgs a) {
  const int64_t t = blockIdx.x;
  const T* gate = static_cast<const T*>(a.input) + t * a.input_stride;
  const T* up = gate + a.d;
  T* out = static_cast<T*>(a.out) + t * a.out_stride;
  for (int i = threadIdx.x; i < a.d; i += kActThreads) {
    const float g = to_float(from_float<T>(activate<A>(to_float(gate[i]))));
    out[i] = from_float<T>(g * to_float(up[i]));
  }
}

template <typename T>
void launch_act_and_mul_typed(const ActAndMulArgs& a, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(a.num_tokens);
  switch (a.activation) {
    case GatedActivation::kSilu:
      return act_and_mul_kernel<T, GatedActivation::kSilu><<<grid, kActThreads, 0, stream>>>(a);
    case GatedActivation::kGelu:
      return act_and_mul_kernel<T, GatedActivation::kGelu><<<grid, kActThreads, 0, stream>>>(a);
    case GatedActivation::kGeluTanh:
      return act_and_mul_kernel<T, GatedActivation::kGeluTanh><<<grid, kActThreads, 0, stream>>>(a);
  }
}

}  // namespace

cudaError_t launch_act_and_mul(const ActAndMulArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL || a.d <= 0) return cudaErrorInvalidConfiguration;
  return dispatch_dtype(a.dtype, [&](auto tag) {
    launch_act_and_mul_typed<decltype(tag)>(a, stream);
    return cudaGetLastError();
  });
}

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL || a.hidden_size <= 0) return cudaErrorInvalidConfiguration;
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T><<<static_cast<unsigned>(a.num_tokens), kNormThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

cudaError_t launch_rotary_embedding_and_cache(const RotaryCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL || a.rot_dim <= 0 || a.rot_dim % 2 != 0) return cudaErrorInvalidConfiguration;
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = static_cast<unsigned>(a.num_tokens);
    if (a.is_neox) {
      rotary_cache_kernel<T, true><<<grid, kRotaryThreads, 0, stream>>>(a);
    } else {
      rotary_cache_kernel<T, false><<<grid, kRotaryThreads, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::cuda
