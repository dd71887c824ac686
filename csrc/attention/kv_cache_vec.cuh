// Reading a quantized KV cache on CUDA: the vector a lane loads for one slice of a K/V
// row, and its conversion to fp32 (common/kv_cache_dtype.h has the formats).
//
// One load covers Vec16<T>::kElems values whatever the format (T: the query/compute
// dtype), so the lane mapping of every kernel is the one of its "auto" variant: a lane
// that loads 16 bytes of fp16 loads 8 bytes of fp8 / int8 codes or 4 bytes of int4 codes
// (fp32: 4, 4 and 2 bytes). The auto format loads and unpacks exactly as before.
//
// fp8 is converted through fp16 bit patterns with integer ops (no fp8 hardware needed,
// any sm): an e5m2 byte is the top byte of an fp16; an e4m3 byte with its exponent and
// mantissa placed at fp16 bit 7 (sign at bit 15) is the same value times 2^-8, subnormals
// included, so fp8_mul() carries that 2^8 into the tensor scale. e4m3's NaN codes are
// never written (writes saturate at +-448).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_utils.cuh"
#include "common/kv_cache_dtype.h"

namespace pagedkv::cuda {

template <int Bytes>
struct RawBytes;
template <>
struct RawBytes<16> {
  using type = uint4;
};
template <>
struct RawBytes<8> {
  using type = uint2;
};
template <>
struct RawBytes<4> {
  using type = uint32_t;
};
template <>
struct RawBytes<2> {
  using type = uint16_t;
};

// The cache-side view of one Vec16<T> slice in format F.
template <typename T, KVCacheDType F>
struct KVVec {
  using Elem = std::conditional_t<F == KVCacheDType::kAuto, T, uint8_t>;  // cache tensor element
  static constexpr int kElems = Vec16<T>::kElems;                         // values per load
  static constexpr int kStored = kElems / values_per_element(F);          // cache elements per load
  using Raw = typename RawBytes<kStored * int(sizeof(Elem))>::type;
};

template <typename Raw>
__device__ __forceinline__ Raw load_raw(const void* p) {
  return __ldg(reinterpret_cast<const Raw*>(p));
}

// The multiplier of a tensor's fp8 codes as fp8_to_float2 returns them (scale: nullptr = 1.0).
__device__ __forceinline__ float fp8_mul(KVCacheDType f, const float* scale) {
  const float s = scale != nullptr ? *scale : 1.f;
  return f == KVCacheDType::kFp8E4M3 ? s * 256.f : s;
}

// Two fp8 codes, each placed in the top byte of a 16-bit lane of `h`, as fp16 values
// (e4m3: times 2^-8), in fp32.
template <KVCacheDType F>
__device__ __forceinline__ float2 fp8_pair_to_float2(uint32_t h) {
  if constexpr (F == KVCacheDType::kFp8E4M3) h = (h & 0x80008000u) | ((h & 0x7f007f00u) >> 1);
  __half2_raw r;
  r.x = static_cast<unsigned short>(h & 0xffffu);
  r.y = static_cast<unsigned short>(h >> 16);
  return __half22float2(__half2(r));
}

// The 32-bit words of a raw vector (fewer than 4 bytes: zero-extended into one word).
template <typename Raw>
__device__ __forceinline__ uint32_t raw_word(const Raw& r, int i) {
  if constexpr (sizeof(Raw) <= 4) {
    return static_cast<uint32_t>(r);
  } else {
    return reinterpret_cast<const uint32_t*>(&r)[i];
  }
}

// The N values of one loaded vector in fp32: auto unpacks as before (mul / zero unused);
// fp8 gives code value * mul (e4m3: see fp8_mul); int8 / int4 give code * mul + zero.
template <typename T, KVCacheDType F, typename Raw, int N>
__device__ __forceinline__ void dequant_vec(const Raw& raw, float (&f)[N], float mul, float zero) {
  if constexpr (F == KVCacheDType::kAuto) {
    unpack(raw, f, T{});
  } else if constexpr (is_fp8(F)) {
    static_assert(N % 4 == 0 && sizeof(Raw) * 1 == N, "one byte per fp8 code");
#pragma unroll
    for (int w = 0; w < N / 4; ++w) {
      const uint32_t x = raw_word(raw, w);
      // Bytes 0, 1 and 2, 3 of x into the top bytes of two 16-bit lanes each.
      const float2 lo = fp8_pair_to_float2<F>(((x & 0xffu) << 8) | ((x & 0xff00u) << 16));
      const float2 hi = fp8_pair_to_float2<F>(((x >> 8) & 0xff00u) | (x & 0xff000000u));
      f[4 * w] = lo.x * mul;
      f[4 * w + 1] = lo.y * mul;
      f[4 * w + 2] = hi.x * mul;
      f[4 * w + 3] = hi.y * mul;
    }
  } else if constexpr (F == KVCacheDType::kInt8PerTokenHead) {
    static_assert(sizeof(Raw) == N, "one byte per int8 code");
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t c = (raw_word(raw, i / 4) >> (8 * (i % 4))) & 0xffu;
      f[i] = fmaf(static_cast<float>(c), mul, zero);
    }
  } else {
    static_assert(2 * sizeof(Raw) == N, "two int4 codes per byte");
    // Element i is nibble i of the little-endian words: low nibble of byte j = element 2j.
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t c = (raw_word(raw, i / 8) >> (4 * (i % 8))) & 0xfu;
      f[i] = fmaf(static_cast<float>(c), mul, zero);
    }
  }
}

// The (scale, zero) pair of one per-token-head row, stored as one fp16x2 word.
__device__ __forceinline__ uint32_t load_pair_bits(const __half* plane, int64_t row) {
  return __ldg(reinterpret_cast<const uint32_t*>(plane) + row);
}
__device__ __forceinline__ float2 pair_of_bits(uint32_t bits) {
  __half2_raw r;
  r.x = static_cast<unsigned short>(bits & 0xffffu);
  r.y = static_cast<unsigned short>(bits >> 16);
  return __half22float2(__half2(r));
}

// The (mul, zero) of dequant_vec for row `row` of one cache: the row's pair for the
// per-token-head formats ((0, 0) when !ok: the row is masked), else (tensor_mul, 0) with
// tensor_mul fp8_mul() of the tensor scale (auto: unused).
template <KVCacheDType F>
__device__ __forceinline__ float2 row_scale(const __half* plane, int64_t row, float tensor_mul, bool ok) {
  if constexpr (is_per_token_head(F)) {
    return ok ? pair_of_bits(load_pair_bits(plane, row)) : make_float2(0.f, 0.f);
  } else {
    return make_float2(tensor_mul, 0.f);
  }
}

// The (scale, zero) words of the tokens one step of a kernel loads: registers only for
// the per-token-head formats (an empty struct otherwise).
template <bool kPerToken, int N>
struct RowPairsImpl {
  uint32_t bits[N];
};
template <int N>
struct RowPairsImpl<false, N> {};
template <KVCacheDType F, int N>
using RowPairs = RowPairsImpl<is_per_token_head(F), N>;

// Dispatches on the cache format: f(FormatTag<F>{}).
template <KVCacheDType F>
struct FormatTag {
  static constexpr KVCacheDType value = F;
};
template <typename Fn>
cudaError_t dispatch_format(KVCacheDType f, Fn&& fn) {
  switch (f) {
    case KVCacheDType::kAuto:
      return fn(FormatTag<KVCacheDType::kAuto>{});
    case KVCacheDType::kFp8E4M3:
      return fn(FormatTag<KVCacheDType::kFp8E4M3>{});
    case KVCacheDType::kFp8E5M2:
      return fn(FormatTag<KVCacheDType::kFp8E5M2>{});
    case KVCacheDType::kInt8PerTokenHead:
      return fn(FormatTag<KVCacheDType::kInt8PerTokenHead>{});
    case KVCacheDType::kInt4PerTokenHead:
      return fn(FormatTag<KVCacheDType::kInt4PerTokenHead>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedkv::cuda
