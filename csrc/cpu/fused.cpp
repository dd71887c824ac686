// CPU entry points of the fused per-layer ops: validate (common/validation.h), fill
// the raw-pointer parameter blocks, run the kernel variant for this CPU.
#include <ATen/ATen.h>

#include "common/validation.h"
#include "cpu/cpu_capability.h"
#include "cpu/fused_kernels.h"
#include "ops.h"

namespace pagedkv {
namespace {

using cpu::CpuCapability;

void run_rms_norm(const cpu::RmsNormParams& p) {
  switch (cpu::selected_cpu_capability()) {
    case CpuCapability::kAvx512Bf16:  // the AVX512 build: nothing here uses bf16 dot products
    case CpuCapability::kAvx512:
      return cpu::AVX512::rms_norm(p);
    case CpuCapability::kAvx2:
      return cpu::AVX2::rms_norm(p);
    case CpuCapability::kDefault:
      break;
  }
  cpu::DEFAULT::rms_norm(p);
}

void run_rotary_cache(const cpu::RotaryCacheParams& p) {
  switch (cpu::selected_cpu_capability()) {
    case CpuCapability::kAvx512Bf16:
    case CpuCapability::kAvx512:
      return cpu::AVX512::rotary_embedding_and_cache(p);
    case CpuCapability::kAvx2:
      return cpu::AVX2::rotary_embedding_and_cache(p);
    case CpuCapability::kDefault:
      break;
  }
  cpu::DEFAULT::rotary_embedding_and_cache(p);
}

void check_cpu(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), op, ": the CPU kernel needs CPU tensors, got one on ", t.device());
}

cpu::RmsNormParams norm_params(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                               double epsilon) {
  cpu::RmsNormParams p{};
  p.dtype = input.scalar_type();
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.input = input.const_data_ptr();
  p.input_stride = input.stride(0);
  p.weight = weight.const_data_ptr();
  p.num_tokens = input.size(0);
  p.hidden_size = input.size(1);
  p.epsilon = static_cast<float>(epsilon);
  return p;
}

}  // namespace

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  constexpr const char* op = "rms_norm";
  check_rms_norm_inputs(op, "out", out, input, weight, epsilon);
  TORCH_CHECK(out.defined(), op, ": out is required");
  check_cpu(op, input);
  run_rms_norm(norm_params(out, input, weight, epsilon));
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  constexpr const char* op = "fused_add_rms_norm";
  check_rms_norm_inputs(op, "residual", residual, input, weight, epsilon);
  TORCH_CHECK(residual.defined(), op, ": residual is required");
  check_cpu(op, input);
  cpu::RmsNormParams p = norm_params(input, input, weight, epsilon);
  p.residual = residual.data_ptr();
  p.residual_stride = residual.stride(0);
  run_rms_norm(p);
}

void rotary_embedding_and_cache_cpu(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                    const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox) {
  constexpr const char* op = "rotary_embedding_and_cache";
  const CacheDims c = check_rotary_cache_inputs(op, positions, query, key, value, key_cache, value_cache,
                                                slot_mapping, cos_sin_cache);
  check_cpu(op, key_cache);
  cpu::RotaryCacheParams p{};
  p.dtype = key_cache.scalar_type();
  p.positions = positions.data_ptr<int64_t>();
  p.query = query.data_ptr();
  p.query_stride_token = query.stride(0);
  p.query_stride_head = query.stride(1);
  p.key = key.data_ptr();
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value = value.const_data_ptr();
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.max_position = cos_sin_cache.size(0);
  p.rot_dim = cos_sin_cache.size(1);
  p.num_tokens = key.size(0);
  p.num_heads = query.size(1);
  p.num_kv_heads = c.num_kv_heads;
  p.head_size = c.head_size;
  p.num_slots = c.num_blocks * c.block_size;
  p.is_neox = is_neox;
  run_rotary_cache(p);
}

}  // namespace pagedkv
