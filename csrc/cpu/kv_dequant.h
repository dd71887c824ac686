// Reading a quantized KV cache on the CPU: one token row of one kv head (head_size
// codes) into fp32. Included by attention_kernels.cpp only, so it is compiled once per
// instruction-set variant (CPU_CAPABILITY), with an AVX-512, an AVX2 and a scalar body.
//
// fp8 goes through fp16: an e5m2 byte is exactly the top byte of an fp16, and an e4m3
// byte placed at fp16 bit 7 (sign at bit 15) is the same value times 2^-8 (exponent
// bias 7 against 15, subnormals included), so vcvtph2ps, which handles fp16
// subnormals in hardware, does the conversion and the 2^8 joins the tensor scale.
// (e4m3's NaN codes are never written: writes saturate at +-448.)
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "common/kv_cache_dtype.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

// What reading one row of a quantized cache needs besides its codes.
struct RowScale {
  float mul;   // fp8: the tensor scale (x 2^8 for e4m3); per-token-head: the row's scale
  float zero;  // per-token-head: the row's zero (min); fp8: 0
};

// The (scale, zero) of one row of a per-token-head cache, from its fp16 plane entry.
inline RowScale plane_scale(const c10::Half* pair) {
  return {static_cast<float>(pair[0]), static_cast<float>(pair[1])};
}

// The multiplier of every fp8 code of a tensor with scale `scale`.
inline float fp8_mul(KVCacheDType f, float scale) { return f == KVCacheDType::kFp8E4M3 ? scale * 256.f : scale; }

// Bytes of one kv head's row in format f (head_size D).
constexpr int64_t row_bytes(KVCacheDType f, int64_t D) { return D / values_per_element(f); }

#if defined(CPU_CAPABILITY_AVX512)
// 16 fp8 codes, sign-extended to 16-bit lanes (cvtepi8), -> fp16 bit patterns: e5m2 is the top byte;
// e4m3 shifted left 7 has its sign at bit 15 (from the extension) and a copy at bit 14, cleared.
inline __m256i fp8_to_half_bits(KVCacheDType f, __m256i x) {
  if (f == KVCacheDType::kFp8E5M2) return _mm256_slli_epi16(x, 8);
  return _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}

template <int D>
inline void dequant_row(KVCacheDType f, const uint8_t* src, RowScale s, float* dst) {
  const __m512 mul = _mm512_set1_ps(s.mul), zero = _mm512_set1_ps(s.zero);
  for (int i = 0; i < D; i += 16) {
    __m512 v;
    if (is_fp8(f)) {
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      v = _mm512_mul_ps(_mm512_cvtph_ps(fp8_to_half_bits(f, x)), mul);
    } else {
      __m128i codes;
      if (f == KVCacheDType::kInt8PerTokenHead) {
        codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      } else {  // 8 bytes -> 16 codes in order: low nibble first
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i / 2));
        const __m128i mask = _mm_set1_epi8(0x0F);
        codes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
      }
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), mul, zero);
    }
    _mm512_storeu_ps(dst + i, v);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 fp8 codes, sign-extended to 16-bit lanes (cvtepi8), -> fp16 bit patterns (as above).
inline __m128i fp8_to_half_bits(KVCacheDType f, __m128i x) {
  if (f == KVCacheDType::kFp8E5M2) return _mm_slli_epi16(x, 8);
  return _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
}

template <int D>
inline void dequant_row(KVCacheDType f, const uint8_t* src, RowScale s, float* dst) {
  const __m256 mul = _mm256_set1_ps(s.mul), zero = _mm256_set1_ps(s.zero);
  for (int i = 0; i < D; i += 8) {
    __m256 v;
    if (is_fp8(f)) {
      const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      v = _mm256_mul_ps(_mm256_cvtph_ps(fp8_to_half_bits(f, x)), mul);
    } else {
      __m128i codes;
      if (f == KVCacheDType::kInt8PerTokenHead) {
        codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
      } else {  // 4 bytes -> 8 codes in order: low nibble first
        int32_t word;
        std::memcpy(&word, src + i / 2, sizeof(word));
        const __m128i b = _mm_cvtsi32_si128(word);
        const __m128i mask = _mm_set1_epi8(0x0F);
        codes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
      }
      v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), mul, zero);
    }
    _mm256_storeu_ps(dst + i, v);
  }
}
#else
template <int D>
inline void dequant_row(KVCacheDType f, const uint8_t* src, RowScale s, float* dst) {
  for (int i = 0; i < D; ++i) {
    float v;
    switch (f) {
      case KVCacheDType::kFp8E4M3:  // the exact value; the 2^8 of fp8_mul comes back out
        v = static_cast<float>(c10::Float8_e4m3fn(src[i], c10::Float8_e4m3fn::from_bits())) * (s.mul / 256.f);
        break;
      case KVCacheDType::kFp8E5M2:
        v = static_cast<float>(c10::Float8_e5m2(src[i], c10::Float8_e5m2::from_bits())) * s.mul;
        break;
      case KVCacheDType::kInt8PerTokenHead:
        v = static_cast<float>(src[i]) * s.mul + s.zero;
        break;
      default:
        v = static_cast<float>((src[i / 2] >> (4 * (i % 2))) & 0x0F) * s.mul + s.zero;
    }
    dst[i] = v;
  }
}
#endif

// How the rows of one layer's quantized K (or V) cache are found and read.
struct QuantRows {
  KVCacheDType format;
  const uint8_t* codes;   // [num_blocks, block_size, num_kv_heads, row_bytes]
  const c10::Half* plane; // per-token-head: [num_blocks, block_size, num_kv_heads, 2]; else nullptr
  float fp8_mul;          // fp8: fp8_mul(format, tensor scale)
  int64_t num_kv_heads;

  // Row `slot` (block * block_size + offset) of kv head h, dequantized into dst[0, D).
  template <int D>
  inline void read(int64_t slot, int64_t h, float* dst) const {
    const int64_t row = slot * num_kv_heads + h;
    const RowScale s = plane ? plane_scale(plane + 2 * row) : RowScale{fp8_mul, 0.f};
    dequant_row<D>(format, codes + row * row_bytes(format, D), s, dst);
  }
};

}  // namespace
}  // namespace pagedkv::cpu::CPU_CAPABILITY
