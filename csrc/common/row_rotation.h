// The fixed rotation of the int4 per-token-head cache (common/kv_cache_dtype.h): every
// K and V row (head_size values of one token and kv head) is stored rotated by the
// normalized Walsh-Hadamard matrix H, block-diagonal with blocks of b = the largest
// power of two dividing head_size (64 for head size 64, 16 for 80, 32 for 96).
// H is orthonormal and symmetric (H = H^T = H^-1), so q . k = (Hq) . (Hk) and
// sum_t p_t v_t = H sum_t p_t (H v_t): attention over rotated rows takes the rotated
// query and rotates its output back, and softmax sees the same logits. The rotation
// spreads a head's outlier channels over all of its values, so one (scale, zero) pair
// per row fits them with 16 levels: on the default model the fidelity bench's mean KL went from 0.117 to
// 0.053 and top-1 agreement from 81.7% to 88.3% (bench/results/kv_fidelity_cpu.md).
//
// The arithmetic is fixed so every implementation agrees bit for bit with
// pagedkv.reference.hadamard_rows: in fp32, stages h = 1, 2, ..., b/2, each replacing
// the pair (x[i], x[i + h]) of every 2h-group by (x[i] + x[i + h], x[i] - x[i + h]), then
// one multiplication by float(1 / sqrt(b)).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/kv_cache_dtype.h"

namespace pagedkv {

// b: the largest power of two dividing head_size (head_size > 0).
constexpr int64_t rotation_block(int64_t head_size) { return head_size & -head_size; }

// Rotates one fp32 row x[0, head_size) in place.
void rotate_row(float* x, int64_t head_size);

// The rows x [..., head_size] (any float dtype, any strides, any device) rotated, as a new
// contiguous fp32 tensor of x's shape. CPU: one pass of rotate_row per row; elsewhere the
// same stages as tensor ops.
at::Tensor rotate_rows(const at::Tensor& x);

// An attention op's query and output around a rotated cache: for such a format, query()
// is the query rotated (in its dtype) and out() a scratch the kernel writes, which finish()
// rotates back into the caller's out; otherwise both are the caller's tensors and finish()
// does nothing.
class RotatedAttention {
 public:
  RotatedAttention(KVCacheDType format, const at::Tensor& query, const at::Tensor& out);
  const at::Tensor& query() const { return query_; }
  at::Tensor& out() { return out_; }
  void finish(at::Tensor& out) const;

 private:
  bool on_;
  at::Tensor query_, out_;
};

}  // namespace pagedkv
