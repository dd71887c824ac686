// CUDA entry points of the fused per-layer ops: validate (common/validation.h), fill
// the launch structs, launch the kernels of csrc/fused/fused_kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

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
  cuda::RmsNormArgs a{};
  a.dtype = cuda::to_kernel_dtype(input.scalar_type());
  a.out = out.data_ptr();
  a.out_stride = out.stride(0);
  a.input = input.const_data_ptr();
  a.input_stride = input.stride(0);
  a.weight = weight.const_data_ptr();
  a.num_tokens = input.size(0);
  a.hidden_size = static_cast<int>(input.size(1));
  a.epsilon = static_cast<float>(epsilon);
  return a;
}

}  // namespace

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
                                     const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache, bool is_neox) {
  constexpr const char* op = "rotary_embedding_and_cache";
  const CacheDims c = check_rotary_cache_inputs(op, positions, query, key, value, key_cache, value_cache,
                                                slot_mapping, cos_sin_cache);
  check_cuda(op, key_cache);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  cuda::RotaryCacheArgs a{};
  a.dtype = cuda::to_kernel_dtype(key_cache.scalar_type());
  a.positions = positions.data_ptr<int64_t>();
  a.query = query.data_ptr();
  a.query_stride_token = query.stride(0);
  a.query_stride_head = query.stride(1);
  a.key = key.data_ptr();
  a.key_stride_token = key.stride(0);
  a.key_stride_head = key.stride(1);
  a.value = value.const_data_ptr();
  a.value_stride_token = value.stride(0);
  a.value_stride_head = value.stride(1);
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  a.max_position = cos_sin_cache.size(0);
  a.rot_dim = static_cast<int>(cos_sin_cache.size(1));
  a.num_tokens = key.size(0);
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_size = static_cast<int>(c.head_size);
  a.num_slots = c.num_blocks * c.block_size;
  a.is_neox = is_neox;
  cuda::check_launch(op, cuda::launch_rotary_embedding_and_cache(a, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("rms_norm", &pagedkv::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cuda);
  m.impl("rotary_embedding_and_cache", &pagedkv::rotary_embedding_and_cache_cuda);
}
