// CPU entry points of the fused per-layer ops: validate (common/validation.h), fill
// the raw-pointer parameter blocks, run the kernel variant for this CPU.
#include <ATen/ATen.h>

#include "common/fused_params.h"
#include "common/validation.h"
#include "cpu/cpu_capability.h"
#include "cpu/fused_kernels.h"
#include "cpu/kv_quant.h"
#include "ops.h"

namespace pagedkv {
namespace {

// The fused kernels are built for DEFAULT, AVX2 and AVX512; the AVX512_BF16 variant runs the
// AVX512 build (nothing here uses bf16 dot products).
template <typename Params>
void run_fused(const Params& p, void (*avx512)(const Params&), void (*avx2)(const Params&),
               void (*fallback)(const Params&)) {
  cpu::run_variant(p, avx512, avx512, avx2, fallback);
}

void run_rms_norm(const cpu::RmsNormParams& p) {
  run_fused(p, cpu::AVX512::rms_norm, cpu::AVX2::rms_norm, cpu::DEFAULT::rms_norm);
}

void run_rotary_cache(const cpu::RotaryCacheParams& p) {
  run_fused(p, cpu::AVX512::rotary_embedding_and_cache, cpu::AVX2::rotary_embedding_and_cache,
              cpu::DEFAULT::rotary_embedding_and_cache);
}

void check_cpu(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), op, ": the CPU kernel needs CPU tensors, got one on ", t.device());
}

cpu::RmsNormParams norm_params(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                               double epsilon) {
  cpu::RmsNormParams p = rms_norm_params<cpu::RmsNormParams>(out, input, weight, epsilon);
  p.dtype = input.scalar_type();
  return p;
}

void act_and_mul_cpu(const char* op, at::Tensor& out, const at::Tensor& input, GatedActivation activation) {
  check_act_and_mul_inputs(op, out, input);
  check_cpu(op, input);
  cpu::ActAndMulParams p = act_and_mul_params<cpu::ActAndMulParams>(out, input, activation);
  p.dtype = input.scalar_type();
  run_fused(p, cpu::AVX512::act_and_mul, cpu::AVX2::act_and_mul, cpu::DEFAULT::act_and_mul);
}

}  // namespace

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cpu("silu_and_mul", out, input, GatedActivation::kSilu);
}

void gelu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cpu("gelu_and_mul", out, input, GatedActivation::kGelu);
}

void gelu_tanh_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cpu("gelu_tanh_and_mul", out, input, GatedActivation::kGeluTanh);
}

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
                                    const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox,
                                    c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale,
                                    std::optional<at::Tensor> v_scale) {
  constexpr const char* op = "rotary_embedding_and_cache";
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const CacheDims c = check_rotary_cache_inputs(op, positions, query, key, value, key_cache, value_cache,
                                                slot_mapping, cos_sin_cache, kv.dims.format);
  check_cpu(op, key_cache);
  cpu::RotaryCacheParams p = rotary_cache_params<cpu::RotaryCacheParams>(
      positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox, c);
  p.dtype = key.scalar_type();
  if (c.format == KVCacheDType::kAuto) return run_rotary_cache(p);
  // A quantized cache: rotate in place with no slot to write (num_slots 0 skips every token),
  // then quantize the rotated key and the value into their slots, as reshape_and_cache does.
  p.num_slots = 0;
  run_rotary_cache(p);
  cpu::write_quantized_tokens(key, value, key_cache, value_cache, slot_mapping, kv);
}

}  // namespace pagedkv
