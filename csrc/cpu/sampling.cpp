// CPU entry point of `sample_from_logits`: validate the tensors and their values, fill
// SampleParams, run the kernel variant for this CPU (sampling_kernels.h).
#include <ATen/ATen.h>

#include <cmath>

#include "cpu/cpu_capability.h"
#include "cpu/sampling_kernels.h"
#include "ops.h"

namespace pagedkv {
namespace {

void check_row_vector(const char* op, const at::Tensor& t, const char* name, int64_t n, c10::ScalarType dtype) {
  TORCH_CHECK(t.defined() && t.dim() == 1 && t.size(0) == n, op, ": ", name, " must be 1-D [", n,
              "] (one per logits row), got shape ", t.defined() ? t.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_cpu(), op, ": ", name, " is on ", t.device(), " but logits are on the CPU");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

}  // namespace

void sample_from_logits_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                            const at::Tensor& uniforms) {
  constexpr const char* op = "sample_from_logits";
  TORCH_CHECK(logits.defined() && logits.dim() == 2, op, ": logits must be 2-D [num_rows, vocab], got shape ",
              logits.defined() ? logits.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.is_cpu(), op, ": the CPU kernel needs CPU tensors, got logits on ", logits.device());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, op, ": the vocabulary must not be empty, got logits of shape ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1 || vocab == 1, op, ": logits rows must be dense (stride 1 along the vocab), got strides ",
              logits.strides());
  check_row_vector(op, out, "out", n, at::kLong);
  check_row_vector(op, temperatures, "temperatures", n, at::kFloat);
  check_row_vector(op, uniforms, "uniforms", n, at::kFloat);
  const float* t = temperatures.const_data_ptr<float>();
  const float* u = uniforms.const_data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(std::isfinite(t[r]) && t[r] >= 0.f, op, ": temperatures[", r, "] = ", t[r],
                " must be finite and >= 0 (0: greedy)");
    TORCH_CHECK(u[r] >= 0.f && u[r] < 1.f, op, ": uniforms[", r, "] = ", u[r], " must be in [0, 1)");
  }
  if (n == 0) return;
  cpu::SampleParams p{out.data_ptr<int64_t>(), logits.const_data_ptr<float>(), logits.stride(0), t, u, n, vocab};
  cpu::run_variant(p, cpu::AVX512::sample_from_logits, cpu::AVX512::sample_from_logits, cpu::AVX2::sample_from_logits,
                   cpu::DEFAULT::sample_from_logits);
}

}  // namespace pagedkv
