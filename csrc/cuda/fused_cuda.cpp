// CUDA entry points of the fused per-layer ops: validate (common/validation.h), fill
// the launch structs, launch the kernels of csrc/fused/fused_kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "common/fused_params.h"
#include "common/validation.h"
#include "fused/fused_launch.h"
#include "cuda/launch_checks.h"
#include "ops.h"

namespace pagedkv {
namespace {

void check_cuda(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": the CUDA kernel needs CUDA tensors, got one on ", t.device());
}

cuda::RmsNormArgs norm_args(const char* op, const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                            double epsilon) {
  TORCH_CHECK(input.size(1) <= 0x7fffffffLL, op, ": hidden_size ", input.size(1), " is too large");
  cuda::RmsNormArgs a = rms_norm_params<cuda::RmsNormArgs>(out, input, weight, epsilon);
  a.dtype = cuda::to_kernel_dtype(input.scalar_type());
  return a;
}

void act_and_mul_cuda(const char* op, at::Tensor& out, const at::Tensor& input, GatedActivation activation) {
  check_act_and_mul_inputs(op, out, input);
  check_cuda(op, input);
  TORCH_CHECK(input.size(1) / 2 <= 0x7fffffffLL, op, ": d ", input.size(1) / 2, " is too large");
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::ActAndMulArgs a = act_and_mul_params<cuda::ActAndMulArgs>(out, input, activation);
  a.dtype = cuda::to_kernel_dtype(input.scalar_type());
  cuda::check_launch(op, cuda::launch_act_and_mul(a, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cuda("silu_and_mul", out, input, GatedActivation::kSilu);
}

void gelu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cuda("gelu_and_mul", out, input, GatedActivation::kGelu);
}

void gelu_tanh_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  act_and_mul_cuda("gelu_tanh_and_mul", out, input, GatedActivation::kGeluTanh);
}

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  constexpr const char* op = "rms_norm";
  check_rms_norm_inputs(op, "out", out, input, weight, epsilon);
  TORCH_CHECK(out.defined(), op, ": out is required");
  check_cuda(op, input);
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::check_launch(op, cuda::launch_rms_norm(norm_args(op, out, input, weight, epsilon),
                                         c10::cuda::getCurrentCUDAStream()));
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double epsilon) {
  constexpr const char* op = "fused_add_rms_norm";
  check_rms_norm_inputs(op, "residual", residual, input, weight, epsilon);
  TORCH_CHECK(residual.defined(), op, ": residual is required");
  check_cuda(op, input);
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::RmsNormArgs a = norm_args(op, input, input, weight, epsilon);
  a.residual = residual.data_ptr();
  a.residual_stride = residual.stride(0);
  cuda::check_launch(op, cuda::launch_rms_norm(a, c10::cuda::getCurrentCUDAStream()));
}

void rotary_embedding_and_cache_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                                     const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                                     const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox,
                                     c10::string_view kv_cache_dtype, std::optional<at::Tensor> k_scale,
                                     std::optional<at::Tensor> v_scale) {
  constexpr const char* op = "rotary_embedding_and_cache";
  const KVCacheArgs kv = check_kv_cache_args(op, kv_cache_dtype, k_scale, v_scale, key_cache, value_cache);
  const CacheDims c = check_rotary_cache_inputs(op, positions, query, key, value, key_cache, value_cache,
                                                slot_mapping, cos_sin_cache, kv.dims.format);
  check_cuda(op, key_cache);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  cuda::RotaryCacheArgs a = rotary_cache_params<cuda::RotaryCacheArgs>(
      positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox, c);
  a.dtype = cuda::to_kernel_dtype(key.scalar_type());
  a.quant = cuda::quant_args(kv);
  if (!rotates_rows(c.format)) {
    cuda::check_launch(op, cuda::launch_rotary_embedding_and_cache(a, c10::cuda::getCurrentCUDAStream()));
    return;
  }
  // A rotated format (common/row_rotation.h): RoPE in place with no slot to write (num_slots 0 skips
  // every token), then reshape_and_cache rotates the rows and quantizes them into their slots.
  a.num_slots = 0;
  cuda::check_launch(op, cuda::launch_rotary_embedding_and_cache(a, c10::cuda::getCurrentCUDAStream()));
  reshape_and_cache_cuda(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale);
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("rms_norm", &pagedkv::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagedkv::silu_and_mul_cuda);
  m.impl("gelu_and_mul", &pagedkv::gelu_and_mul_cuda);
  m.impl("gelu_tanh_and_mul", &pagedkv::gelu_tanh_and_mul_cuda);
  m.impl("rotary_embedding_and_cache", &pagedkv::rotary_embedding_and_cache_cuda);
}
