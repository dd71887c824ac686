// Writing a quantized KV cache on CUDA: one (token, kv head) row at a time, by one warp.
// The rule is the one of python/pagedkv/reference.py quantize_kv and csrc/cpu/kv_quant.cpp,
// bit for bit (common/kv_cache_dtype.h):
//  - fp8: c = fp8_RNE(clamp(x * inv, +-max)), inv = 1 / scale in fp32 (cuda_fp8.h's
//    conversion rounds to nearest even, as c10's does).
//  - per token and head: lo / hi = min / max of the row (warp shuffles: exact), clamped to
//    +-65504; scale_h = fp16_RN((hi - lo) / Q), zero_h = fp16_RN(lo); s, z their fp32
//    values, inv = s > 0 ? 1 / s : 0; code = clamp(rint((x - z) * inv), 0, Q); int4 packs
//    element 2i in the low nibble of byte i.
// The arithmetic is spelled with the _rn intrinsics: the build uses --use_fast_math, whose
// approximate division would break the bit-exactness (and none of these may be fused).
// Comparisons, not fminf / fmaxf, do the fp8 clamp, so a NaN stays a NaN as in c10.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/attention_utils.cuh"
#include "cache/cache_launch.h"
#include "common/kv_cache_dtype.h"

namespace pagedkv::cuda {

template <int LO, int HI>
__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int o = LO; o < HI; o *= 2) x = fminf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

__device__ __forceinline__ uint8_t fp8_code(float x, float inv, KVCacheDType f) {
  const float max = fp8_max(f);
  float v = __fmul_rn(x, inv);
  v = v < -max ? -max : (v > max ? max : v);
  const __nv_fp8_interpretation_t kind = f == KVCacheDType::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind));
}

// The (scale, zero) of a per-token-head row as stored and as the codes use them.
struct RowQuant {
  __half scale_h, zero_h;
  float zero, inv;
  float code_max;
};

__device__ __forceinline__ RowQuant row_quant(float lo, float hi, int code_max) {
  lo = fminf(fmaxf(lo, -kFp16Max), kFp16Max);
  hi = fminf(fmaxf(hi, -kFp16Max), kFp16Max);
  RowQuant r;
  r.code_max = static_cast<float>(code_max);
  r.scale_h = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), r.code_max));
  r.zero_h = __float2half_rn(lo);
  const float s = __half2float(r.scale_h);
  r.zero = __half2float(r.zero_h);
  r.inv = s > 0.f ? __frcp_rn(s) : 0.f;
  return r;
}

__device__ __forceinline__ uint32_t code_of(float x, const RowQuant& r) {
  const float c = rintf(__fmul_rn(__fsub_rn(x, r.zero), r.inv));
  return static_cast<uint32_t>(fminf(fmaxf(c, 0.f), r.code_max));
}

// Writes row x[0, D) (stride 1, compute dtype T) of one cache in format f: codes at `codes`
// (D or D / 2 bytes), the (scale, zero) pair at `pair` (per-token-head), `inv` = 1 / fp8
// scale. Every lane of the warp calls it (the row's min / max are warp reductions).
template <typename T>
__device__ void quantize_row(KVCacheDType f, const T* x, int D, uint8_t* codes, __half* pair, float inv,
                             int lane) {
  if (is_fp8(f)) {
    for (int i = lane; i < D; i += 32) codes[i] = fp8_code(to_float(x[i]), inv, f);
    return;
  }
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < D; i += 32) {
    const float v = to_float(x[i]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const RowQuant r = row_quant(warp_min<1, 32>(lo), warp_max<1, 32>(hi), code_max(f));
  if (lane == 0) {
    pair[0] = r.scale_h;
    pair[1] = r.zero_h;
  }
  if (f == KVCacheDType::kInt8PerTokenHead) {
    for (int i = lane; i < D; i += 32) codes[i] = static_cast<uint8_t>(code_of(to_float(x[i]), r));
    return;
  }
  for (int j = lane; j < D / 2; j += 32) {
    const uint32_t c0 = code_of(to_float(x[2 * j]), r), c1 = code_of(to_float(x[2 * j + 1]), r);
    codes[j] = static_cast<uint8_t>(c0 | (c1 << 4));
  }
}

// Quantizes the key and value rows of one token into slot `slot`, one warp per row
// (warps `warp` of `num_warps`). key / value: the token's rows, head h at h * head stride.
template <typename T>
__device__ void quantize_token(const KVQuantArgs& q, const T* key, int64_t key_head_stride, const T* value,
                               int64_t value_head_stride, void* key_cache, void* value_cache, int64_t slot,
                               int num_kv_heads, int head_size, int warp, int num_warps, int lane) {
  const int row_bytes = head_size / values_per_element(q.format);
  const bool fp8 = is_fp8(q.format);
  const float k_inv = fp8 && q.k_scale != nullptr ? __frcp_rn(*q.k_scale) : 1.f;
  const float v_inv = fp8 && q.v_scale != nullptr ? __frcp_rn(*q.v_scale) : 1.f;
  for (int r = warp; r < 2 * num_kv_heads; r += num_warps) {
    const bool is_value = r >= num_kv_heads;
    const int h = is_value ? r - num_kv_heads : r;
    const int64_t row = slot * num_kv_heads + h;
    const T* x = is_value ? value + h * value_head_stride : key + h * key_head_stride;
    uint8_t* codes = static_cast<uint8_t*>(is_value ? value_cache : key_cache) + row * row_bytes;
    __half* plane = is_value ? q.v_plane : q.k_plane;
    quantize_row(q.format, x, head_size, codes, plane != nullptr ? plane + 2 * row : nullptr,
                 is_value ? v_inv : k_inv, lane);
  }
}

}  // namespace pagedkv::cuda
