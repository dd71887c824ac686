// CPU entry points of the linear layer on packed weights: pack_linear_weight builds the
// layout of gemm_kernels.h; packed_linear validates its tensors, fills the parameter
// block and runs the kernel variant of this CPU.
#include <ATen/ATen.h>

#include <algorithm>

#include "common/validation.h"
#include "cpu/cpu_capability.h"
#include "cpu/gemm_kernels.h"
#include "ops.h"

namespace pagedkv {

namespace cpu {

std::vector<int64_t> equal_cost_runs(const std::vector<int64_t>& cost_before, int64_t parts) {
  const int64_t num_tasks = static_cast<int64_t>(cost_before.size()) - 1;
  std::vector<int64_t> bounds(parts + 1, num_tasks);
  bounds[0] = 0;
  for (int64_t i = 1; i < parts; ++i) {
    // The first task that starts at or past i / parts of the total cost.
    const int64_t target = cost_before[num_tasks] * i / parts;
    bounds[i] = std::lower_bound(cost_before.begin(), cost_before.end() - 1, target) - cost_before.begin();
  }
  return bounds;
}

}  // namespace cpu

namespace {

bool is_packable(c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// Input elements per packed panel row of a weight of dtype t: one fp32, or a pair of bf16.
int64_t per_row(c10::ScalarType t) { return t == at::kBFloat16 ? 2 : 1; }

void check_dense_rows(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
              " rows must be dense (stride 1 along the last dim), got strides ", t.strides());
}

void check_packed_linear_inputs(const char* op, const at::Tensor& out, const at::Tensor& input,
                                const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.defined() && out.defined() && packed.defined(), op, ": out, input and packed_weight are required");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [num_tokens, in_features], got shape ", input.sizes());
  const c10::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(is_packable(dtype), op, ": input dtype ", dtype, " is not supported; supported: float32, bfloat16");
  TORCH_CHECK(input.is_cpu(), op, ": the CPU kernel needs CPU tensors, got input on ", input.device());
  TORCH_CHECK(input.size(1) > 0, op, ": in_features must be positive, got input of shape ", input.sizes());
  check_dense_rows(op, input, "input");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == input.size(0) && out.size(1) > 0, op, ": out must be [",
              input.size(0), ", out_features] for input of shape ", input.sizes(), ", got shape ", out.sizes());
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out dtype ", out.scalar_type(), " differs from input dtype ", dtype);
  TORCH_CHECK(out.is_cpu(), op, ": out is on ", out.device(), " but input is on the CPU");
  check_dense_rows(op, out, "out");
  TORCH_CHECK(packed.scalar_type() == dtype, op, ": packed_weight dtype ", packed.scalar_type(),
              " differs from input dtype ", dtype);
  TORCH_CHECK(packed.is_cpu(), op, ": packed_weight is on ", packed.device(), " but input is on the CPU");
  const std::vector<int64_t> expected = packed_linear_weight_shape(out.size(1), input.size(1), dtype);
  TORCH_CHECK(packed.sizes() == c10::IntArrayRef(expected), op, ": packed_weight must have shape ",
              c10::IntArrayRef(expected), " (pack_linear_weight of a [", out.size(1), ", ", input.size(1),
              "] ", dtype, " weight), got ", packed.sizes());
  TORCH_CHECK(packed.is_contiguous(), op, ": packed_weight must be contiguous (as pack_linear_weight returns it)");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out.size(1), op, ": bias must be [", out.size(1),
                "], got shape ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == dtype, op, ": bias dtype ", bias->scalar_type(), " differs from input dtype ",
                dtype);
    TORCH_CHECK(bias->is_cpu(), op, ": bias is on ", bias->device(), " but input is on the CPU");
    TORCH_CHECK(bias->is_contiguous(), op, ": bias must be contiguous, got strides ", bias->strides());
  }
  // Output tiles are written while the inputs are still being read.
  check_disjoint(op, out, "out", input, "input");
  check_disjoint(op, out, "out", packed, "packed_weight");
  if (bias.has_value() && bias->defined()) check_disjoint(op, out, "out", *bias, "bias");
}

}  // namespace

// The layout of gemm_kernels.h.
std::vector<int64_t> packed_linear_weight_shape(int64_t N, int64_t K, c10::ScalarType t) {
  const int64_t panels = (N + cpu::kPanelWidth - 1) / cpu::kPanelWidth;
  const int64_t rows = (K + per_row(t) - 1) / per_row(t);
  if (t == at::kBFloat16) return {panels, rows, cpu::kPanelWidth, 2};
  return {panels, rows, cpu::kPanelWidth};
}

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  constexpr const char* op = "pack_linear_weight";
  TORCH_CHECK(weight.defined() && weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ",
              weight.defined() ? weight.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(is_packable(weight.scalar_type()), op, ": weight dtype ", weight.scalar_type(),
              " is not supported; supported: float32, bfloat16");
  TORCH_CHECK(weight.is_cpu(), op, ": weight must be a CPU tensor, got one on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N > 0 && K > 0, op, ": weight must not be empty, got shape ", weight.sizes());
  const std::vector<int64_t> shape = packed_linear_weight_shape(N, K, weight.scalar_type());
  const int64_t panels = shape[0], rows = shape[1], step = per_row(weight.scalar_type());
  // Zero padding: the last panel's missing features and bf16's missing pair element of an odd K.
  at::Tensor padded = at::zeros({panels * cpu::kPanelWidth, rows * step}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [panels, 48, rows, step] -> [panels, rows, 48, step]
  at::Tensor packed = padded.view({panels, cpu::kPanelWidth, rows, step}).permute({0, 2, 1, 3}).contiguous();
  return packed.view(shape);
}

namespace {

// The kernel's parameters for out = input @ W^T (+ bias), the tensors already checked.
cpu::PackedLinearParams linear_params(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                                      const void* bias) {
  cpu::PackedLinearParams p;
  p.dtype = input.scalar_type();
  p.input = input.const_data_ptr();
  p.input_stride = input.stride(0);
  p.weight = packed_weight.const_data_ptr();
  p.bias = bias;
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.M = input.size(0);
  p.N = out.size(1);
  p.K = input.size(1);
  return p;
}

void run_variant_batch(const std::vector<cpu::PackedLinearParams>& problems) {
  if (problems.empty()) return;
  const cpu::PackedLinearBatch batch{problems.data(), static_cast<int64_t>(problems.size())};
  cpu::run_variant(batch, cpu::AVX512_BF16::packed_linear, cpu::AVX512::packed_linear, cpu::AVX2::packed_linear,
                   cpu::DEFAULT::packed_linear);
}

// bf16 products of kAmxMinRows rows or more on AMX tiles where enabled, the rest (and every
// product elsewhere) on the variant's register tiles.
void run_batch(const std::vector<cpu::PackedLinearParams>& problems) {
  if (problems.empty() || problems[0].dtype != at::kBFloat16 || !cpu::cpu_amx_enabled()) {
    return run_variant_batch(problems);
  }
  std::vector<cpu::PackedLinearParams> few, many;
  for (const cpu::PackedLinearParams& p : problems) (p.M >= cpu::kAmxMinRows ? many : few).push_back(p);
  if (!many.empty()) {
    cpu::AVX512_BF16::packed_linear_amx({many.data(), static_cast<int64_t>(many.size())});
  }
  run_variant_batch(few);
}

}  // namespace

void packed_linear_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "packed_linear";
  check_packed_linear_inputs(op, out, input, packed_weight, bias);
  run_batch({linear_params(out, input, packed_weight,
                           bias.has_value() && bias->defined() ? bias->const_data_ptr() : nullptr)});
}

void packed_linear_grouped_cpu(at::Tensor& out, const at::Tensor& input, at::TensorList packed_weights,
                               const std::vector<int64_t>& groups, const std::vector<int64_t>& offsets) {
  constexpr const char* op = "packed_linear (grouped)";
  std::vector<cpu::PackedLinearParams> problems;
  problems.reserve(groups.size());
  for (int64_t g : groups) {
    TORCH_CHECK(g >= 0 && g + 1 < static_cast<int64_t>(offsets.size()) && g < static_cast<int64_t>(packed_weights.size()),
                op, ": group ", g, " is out of range (", offsets.size() - 1, " groups of rows, ", packed_weights.size(),
                " weights)");
    const int64_t begin = offsets[g], rows = offsets[g + 1] - offsets[g];
    at::Tensor out_rows = out.narrow(0, begin, rows);
    const at::Tensor in_rows = input.narrow(0, begin, rows);
    check_packed_linear_inputs(op, out_rows, in_rows, packed_weights[g], std::nullopt);
    problems.push_back(linear_params(out_rows, in_rows, packed_weights[g], nullptr));
  }
  run_batch(problems);
}

}  // namespace pagedkv
