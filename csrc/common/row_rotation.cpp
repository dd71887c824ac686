#include "common/row_rotation.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace pagedkv {
namespace {

// float(1 / sqrt(b)): computed in double and rounded once, as the reference does.
float rotation_scale(int64_t b) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(b))); }

// One stage h of one block: every pair (lo[i], hi[i]) of each 2h-group becomes (lo + hi, lo - hi).
// Distinct restrict halves let the compiler vectorize stages with h >= 4 (the small first stages
// are unrolled by hand: the generic loop spent most of its time in loop control there).
inline void butterfly(float* __restrict lo, float* __restrict hi, int64_t h) {
  for (int64_t i = 0; i < h; ++i) {
    const float a = lo[i], c = hi[i];
    lo[i] = a + c;
    hi[i] = a - c;
  }
}

// Stages h = 1 and 2 of four consecutive values.
inline void butterfly4(float* r) {
  const float a0 = r[0] + r[1], a1 = r[0] - r[1], a2 = r[2] + r[3], a3 = r[2] - r[3];
  r[0] = a0 + a2;
  r[1] = a1 + a3;
  r[2] = a0 - a2;
  r[3] = a1 - a3;
}

}  // namespace

void rotate_row(float* x, int64_t head_size) {
  const int64_t b = rotation_block(head_size);
  const float s = rotation_scale(b);
  for (int64_t base = 0; base < head_size; base += b) {
    float* r = x + base;
    int64_t h = 1;
    if (b >= 4) {
      for (int64_t g = 0; g < b; g += 4) butterfly4(r + g);
      h = 4;
    }
    for (; h < b; h *= 2) {
      for (int64_t g = 0; g < b; g += 2 * h) butterfly(r + g, r + g + h, h);
    }
    for (int64_t i = 0; i < b; ++i) r[i] *= s;
  }
}

at::Tensor rotate_rows(const at::Tensor& x) {
  const int64_t d = x.size(-1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  y.copy_(x);
  if (y.numel() == 0) return y;
  if (y.is_cpu()) {
    float* p = y.data_ptr<float>();
    // A decode step's query is a few thousand rows at most: threads only pay from ~256K values on.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / d);
    at::parallel_for(0, y.numel() / d, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rotate_row(p + r * d, d);
    });
    return y;
  }
  // The same stages as tensor ops (a CUDA graph captures them like any other kernels).
  const int64_t b = rotation_block(d);
  at::Tensor z = y.view({-1, b});
  for (int64_t h = 1; h < b; h *= 2) {
    const at::Tensor v = z.view({-1, b / (2 * h), 2, h});
    const at::Tensor a = v.select(2, 0), c = v.select(2, 1);
    z = at::stack({a + c, a - c}, 2).view({-1, b});
  }
  return z.mul_(static_cast<double>(rotation_scale(b))).view(x.sizes());
}

RotatedAttention::RotatedAttention(KVCacheDType format, const at::Tensor& query, const at::Tensor& out)
    : on_(rotates_rows(format)) {
  if (!on_) {
    query_ = query;
    out_ = out;
    return;
  }
  query_ = rotate_rows(query).to(query.scalar_type());
  out_ = at::empty(out.sizes(), out.options());
}

void RotatedAttention::finish(at::Tensor& out) const {
  if (on_) out.copy_(rotate_rows(out_));
}

}  // namespace pagedkv
