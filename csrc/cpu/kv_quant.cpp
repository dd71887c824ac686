#include "cpu/kv_quant.h"

#include "common/row_rotation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pagedkv::cpu {
namespace {

// One token row of one kv head, widened to fp32 (head_size values).
template <typename T>
void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename Fp8>
void quantize_fp8(const float* x, int64_t n, float inv_scale, float max, uint8_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::clamp(x[i] * inv_scale, -max, max);
    dst[i] = Fp8(v).x;
  }
}

// (scale, zero) of a row, as stored (fp16) and as read back (fp32).
struct RowParams {
  c10::Half scale_h, zero_h;
  float scale, zero, inv;
};

RowParams row_params(const float* x, int64_t n, int code_max) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  lo = std::clamp(lo, -kFp16Max, kFp16Max);
  hi = std::clamp(hi, -kFp16Max, kFp16Max);
  RowParams r;
  r.scale_h = c10::Half((hi - lo) / static_cast<float>(code_max));
  r.zero_h = c10::Half(lo);
  r.scale = static_cast<float>(r.scale_h);
  r.zero = static_cast<float>(r.zero_h);
  r.inv = r.scale > 0.f ? 1.f / r.scale : 0.f;
  return r;
}

inline int code_of(float x, const RowParams& r, int code_max) {
  const float c = std::nearbyint((x - r.zero) * r.inv);
  return static_cast<int>(std::clamp(c, 0.f, static_cast<float>(code_max)));
}

// Quantizes one row x[0, n) into dst (n or n / 2 bytes) and its (scale, zero) pair.
void quantize_per_token_head(KVCacheDType f, const float* x, int64_t n, uint8_t* dst, c10::Half* pair) {
  const int q = code_max(f);
  const RowParams r = row_params(x, n, q);
  pair[0] = r.scale_h;
  pair[1] = r.zero_h;
  if (f == KVCacheDType::kInt8PerTokenHead) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint8_t>(code_of(x[i], r, q));
    return;
  }
  for (int64_t i = 0; i < n; i += 2) {
    dst[i / 2] = static_cast<uint8_t>(code_of(x[i], r, q) | (code_of(x[i + 1], r, q) << 4));
  }
}

// Quantizes row x of kv head h into slot `slot` of one cache (codes base, plane or scale).
struct CacheWriter {
  KVCacheDType format;
  uint8_t* codes;
  c10::Half* plane;  // per-token-head
  float inv_scale;   // fp8
  int64_t num_kv_heads, head_size;

  // x: the row widened to fp32, which a rotated format rotates in place first.
  void write(int64_t slot, int64_t h, float* x) const {
    const int64_t row = slot * num_kv_heads + h;
    if (rotates_rows(format)) rotate_row(x, head_size);
    uint8_t* dst = codes + row * (head_size / values_per_element(format));
    switch (format) {
      case KVCacheDType::kFp8E4M3:
        return quantize_fp8<c10::Float8_e4m3fn>(x, head_size, inv_scale, fp8_max(format), dst);
      case KVCacheDType::kFp8E5M2:
        return quantize_fp8<c10::Float8_e5m2>(x, head_size, inv_scale, fp8_max(format), dst);
      default:
        return quantize_per_token_head(format, x, head_size, dst, plane + 2 * row);
    }
  }
};

CacheWriter writer(at::Tensor& cache, const at::Tensor& scale, const CacheDims& c) {
  CacheWriter w{c.format, static_cast<uint8_t*>(cache.data_ptr()), nullptr, 1.f, c.num_kv_heads, c.head_size};
  if (is_per_token_head(c.format)) {
    w.plane = static_cast<c10::Half*>(scale.data_ptr());
  } else if (scale.defined()) {
    w.inv_scale = 1.f / scale.item<float>();
  }
  return w;
}

template <typename T>
void write_tokens(const at::Tensor& key, const at::Tensor& value, const int64_t* slots, const CacheWriter& kw,
                  const CacheWriter& vw) {
  const int64_t num_tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const T* k = key.const_data_ptr<T>();
  const T* v = value.const_data_ptr<T>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      for (int64_t h = 0; h < heads; ++h) {
        widen(k + t * key.stride(0) + h * key.stride(1), d, row.data());
        kw.write(slots[t], h, row.data());
        widen(v + t * value.stride(0) + h * value.stride(1), d, row.data());
        vw.write(slots[t], h, row.data());
      }
    }
  });
}

}  // namespace

void write_quantized_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping, const KVCacheArgs& kv) {
  const CacheWriter kw = writer(key_cache, kv.k_scale, kv.dims);
  const CacheWriter vw = writer(value_cache, kv.v_scale, kv.dims);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  switch (key.scalar_type()) {
    case at::kFloat:
      return write_tokens<float>(key, value, slots, kw, vw);
    case at::kHalf:
      return write_tokens<c10::Half>(key, value, slots, kw, vw);
    case at::kBFloat16:
      return write_tokens<c10::BFloat16>(key, value, slots, kw, vw);
    default:
      TORCH_CHECK(false, "pagedkv: no quantizing cache writer for ", key.scalar_type());
  }
}

}  // namespace pagedkv::cpu
