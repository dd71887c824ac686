// Reading a quantized KV cache on the CPU: one token row of one kv head (head_size
// codes) into fp32. Included by attention_kernels.cpp only, so it is compiled once per
// instruction-set variant (CPU_CAPABILITY), with an AVX-512, an AVX2 and a scalar body.
//
// The capability-specific part is the widening primitives (load_codes, load_int4_codes,
// load_int4_halves) that the dequantizer here and the decode kernel's direct reads share.
// fp8 goes through fp16: an e5m2 byte is exactly the top byte of an fp16, and an e4m3
// byte placed at fp16 bit 7 (sign at bit 15) is the same value times 2^-8 (exponent
// bias 7 against 15, subnormals included), so vcvtph2ps, which handles fp16
// subnormals in hardware, does the conversion and the 2^8 joins the tensor scale.
// (e4m3's NaN codes are never written: writes saturate at +-448.)
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
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

using CodeVec = at::vec::Vectorized<float>;
constexpr int kCodeLanes = CodeVec::size();

#if defined(CPU_CAPABILITY_AVX512)
// 16 fp8 codes, sign-extended to 16-bit lanes (cvtepi8), -> fp16 bit patterns: e5m2 is the top byte;
// e4m3 shifted left 7 has its sign at bit 15 (from the extension) and a copy at bit 14, cleared.
inline __m256i fp8_to_half_bits(KVCacheDType f, __m256i x) {
  if (f == KVCacheDType::kFp8E5M2) return _mm256_slli_epi16(x, 8);
  return _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 fp8 codes, sign-extended to 16-bit lanes (cvtepi8), -> fp16 bit patterns (as above).
inline __m128i fp8_to_half_bits(KVCacheDType f, __m128i x) {
  if (f == KVCacheDType::kFp8E5M2) return _mm_slli_epi16(x, 8);
  return _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
}
#endif

// kCodeLanes fp8 or int8 codes from p, widened to fp32: fp8 through fp16 (an e4m3 value comes out
// 2^-8 times itself, fp8_mul's 2^8 puts it back), int8 codes as the integers they are.
template <KVCacheDType F>
inline CodeVec load_codes(const uint8_t* p) {
  static_assert(is_fp8(F) || F == KVCacheDType::kInt8PerTokenHead, "int4 codes: load_int4_codes");
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (is_fp8(F)) return CodeVec(_mm512_cvtph_ps(fp8_to_half_bits(F, _mm256_cvtepi8_epi16(raw))));
  return CodeVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (is_fp8(F)) return CodeVec(_mm256_cvtph_ps(fp8_to_half_bits(F, _mm_cvtepi8_epi16(raw))));
  return CodeVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)));
#else
  float lanes[kCodeLanes];
  for (int i = 0; i < kCodeLanes; ++i) {
    if constexpr (F == KVCacheDType::kFp8E4M3) {
      lanes[i] = static_cast<float>(c10::Float8_e4m3fn(p[i], c10::Float8_e4m3fn::from_bits())) * (1.f / 256.f);
    } else if constexpr (F == KVCacheDType::kFp8E5M2) {
      lanes[i] = static_cast<float>(c10::Float8_e5m2(p[i], c10::Float8_e5m2::from_bits()));
    } else {
      lanes[i] = static_cast<float>(p[i]);
    }
  }
  return CodeVec::loadu(lanes);
#endif
}

// kCodeLanes int4 codes (kCodeLanes / 2 bytes from p, element 2i in the low nibble of byte i) as fp32.
inline CodeVec load_int4_codes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  __m128i b;
#if defined(CPU_CAPABILITY_AVX512)
  b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
#else
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  b = _mm_cvtsi32_si128(word);
#endif
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
#if defined(CPU_CAPABILITY_AVX512)
  return CodeVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)));
#else
  return CodeVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
#endif
#else
  float lanes[kCodeLanes];
  for (int i = 0; i < kCodeLanes; ++i) lanes[i] = static_cast<float>((p[i / 2] >> (4 * (i % 2))) & 0x0F);
  return CodeVec::loadu(lanes);
#endif
}

// 2 * kCodeLanes int4 codes (kCodeLanes bytes from p) as fp32 in two vectors: even gets the
// low nibbles (elements 2i), odd the high ones (2i + 1). One widening serves both, where the
// in-order load_int4_codes interleaves the nibbles first; the decode kernel keeps its query and
// accumulators in this order instead.
inline void load_int4_halves(const uint8_t* p, CodeVec& even, CodeVec& odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = CodeVec(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(0x0F))));
  odd = CodeVec(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  even = CodeVec(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0x0F))));
  odd = CodeVec(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)));
#else
  float lo[kCodeLanes], hi[kCodeLanes];
  for (int i = 0; i < kCodeLanes; ++i) {
    lo[i] = static_cast<float>(p[i] & 0x0F);
    hi[i] = static_cast<float>(p[i] >> 4);
  }
  even = CodeVec::loadu(lo);
  odd = CodeVec::loadu(hi);
#endif
}

// One row (D codes) of format f dequantized into dst: fp8 code * scale, per-token code * scale + zero.
template <int D>
inline void dequant_row(KVCacheDType f, const uint8_t* src, RowScale s, float* dst) {
  const CodeVec mul(s.mul), zero(s.zero);
  for (int i = 0; i < D; i += kCodeLanes) {
    CodeVec v;
    switch (f) {
      case KVCacheDType::kFp8E4M3:
        v = load_codes<KVCacheDType::kFp8E4M3>(src + i) * mul;
        break;
      case KVCacheDType::kFp8E5M2:
        v = load_codes<KVCacheDType::kFp8E5M2>(src + i) * mul;
        break;
      case KVCacheDType::kInt8PerTokenHead:
        v = at::vec::fmadd(load_codes<KVCacheDType::kInt8PerTokenHead>(src + i), mul, zero);
        break;
      default:
        v = at::vec::fmadd(load_int4_codes(src + i / 2), mul, zero);
    }
    v.store(dst + i);
  }
}

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
