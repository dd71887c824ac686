// The KV cache's storage formats (kv_cache_dtype, vLLM's names), in one place for
// the op checks, the CPU kernels and the CUDA kernels. Plain C++ (no torch headers).
//
// Layout (python/pagedkv/kv_cache.py has the full table): K and V are each
// [num_blocks, block_size, num_kv_heads, X] with X = head_size, or head_size / 2 for
// int4 (element 2i in the low nibble of byte i, 2i + 1 in the high one).
//  - fp8 (e4m3 / e5m2): code = fp8(clamp(x / scale, +-max)), one fp32 scale per tensor.
//  - int8 / int4 per token and head: uint8 codes, asymmetric: a (scale, zero) fp16 pair
//    per token and kv head in a plane [num_blocks, block_size, num_kv_heads, 2], read
//    as code * scale + zero. int4 rows are stored rotated (common/row_rotation.h).
#pragma once

#include <cstdint>

namespace pagedkv {

enum class KVCacheDType : int {
  kAuto = 0,  // the compute dtype
  kFp8E4M3 = 1,
  kFp8E5M2 = 2,
  kInt8PerTokenHead = 3,
  kInt4PerTokenHead = 4,
};

inline constexpr const char* kSupportedKVCacheDtypes =
    "auto, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head, int4_per_token_head";

constexpr bool is_fp8(KVCacheDType f) { return f == KVCacheDType::kFp8E4M3 || f == KVCacheDType::kFp8E5M2; }
constexpr bool is_per_token_head(KVCacheDType f) {
  return f == KVCacheDType::kInt8PerTokenHead || f == KVCacheDType::kInt4PerTokenHead;
}
// Whether rows are stored rotated by the fixed Walsh-Hadamard rotation (common/row_rotation.h):
// int4 only, whose 16 levels per row cannot hold a head's outlier channels unrotated.
constexpr bool rotates_rows(KVCacheDType f) { return f == KVCacheDType::kInt4PerTokenHead; }
// Codes per stored byte/element of the cache's last dimension.
constexpr int values_per_element(KVCacheDType f) { return f == KVCacheDType::kInt4PerTokenHead ? 2 : 1; }
// Largest code of the per-token-head formats (2^bits - 1).
constexpr int code_max(KVCacheDType f) { return f == KVCacheDType::kInt4PerTokenHead ? 15 : 255; }
// Largest finite value of the fp8 formats: writes saturate there.
constexpr float fp8_max(KVCacheDType f) { return f == KVCacheDType::kFp8E5M2 ? 57344.f : 448.f; }
// The (scale, zero) pair is stored in fp16: values beyond this are clamped first.
inline constexpr float kFp16Max = 65504.f;

}  // namespace pagedkv
