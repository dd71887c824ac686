// CPU entry points of `sample_from_logits` (validate the tensors and their values, fill
// SampleParams, run the kernel variant for this CPU: sampling_kernels.h) and of
// `apply_token_bitmask` (structured outputs' per-row token masks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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

// float32 CPU logits [num_rows, vocab] with dense rows (the checks both ops make first).
void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.defined() && logits.dim() == 2, op, ": logits must be 2-D [num_rows, vocab], got shape ",
              logits.defined() ? logits.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.is_cpu(), op, ": the CPU kernel needs CPU tensors, got logits on ", logits.device());
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) <= 1, op,
              ": logits rows must be dense (stride 1 along the vocab), got strides ", logits.strides());
}

}  // namespace

void sample_from_logits_cpu(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                            const at::Tensor& uniforms) {
  constexpr const char* op = "sample_from_logits";
  check_logits(op, logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, op, ": the vocabulary must not be empty, got logits of shape ", logits.sizes());
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

void apply_token_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  constexpr const char* op = "apply_token_bitmask";
  check_logits(op, logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int64_t words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.defined() && bitmask.dim() == 2 && bitmask.size(1) == words, op,
              ": bitmask must be 2-D [num_masks, ceil(vocab / 32) = ", words, "], got shape ",
              bitmask.defined() ? bitmask.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, op, ": bitmask must be int32, got ", bitmask.scalar_type());
  TORCH_CHECK(bitmask.is_cpu() && bitmask.is_contiguous(), op, ": bitmask must be a contiguous CPU tensor, got ",
              bitmask.device(), " with strides ", bitmask.strides());
  const int64_t m = bitmask.size(0);
  check_row_vector(op, rows, "rows", m, at::kLong);
  const int64_t* row_of = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < n, op, ": rows[", i, "] = ", row_of[i], " is outside the ", n,
                " logits rows");
  }
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.const_data_ptr<int32_t>());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + row_of[i] * stride;
      const uint32_t* bits = mask + i * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t allowed = bits[w];
        if (allowed == 0xFFFFFFFFu) continue;  // the common case in a permissive state: nothing to mask
        const int64_t first = w * 32;
        if (allowed == 0) {  // a whole word forbidden: one fill (the common case in a strict state)
          std::fill_n(row + first, std::min<int64_t>(32, vocab - first), kNegInf);
          continue;
        }
        // Only the forbidden bits, lowest first; bits past the vocabulary (the last word's padding) are skipped.
        for (uint32_t forbidden = ~allowed; forbidden != 0; forbidden &= forbidden - 1) {
          const int64_t t = first + __builtin_ctz(forbidden);
          if (t >= vocab) break;
          row[t] = kNegInf;
        }
      }
    }
  });
}

}  // namespace pagedkv
