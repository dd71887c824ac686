// The parameter blocks of the fused per-layer ops, filled from their (validated)
// tensors once for both backends: the CPU kernels' structs (cpu/fused_kernels.h)
// and the CUDA launch structs (fused/fused_launch.h) share their field names, and
// each field narrows to its own type (the CUDA structs hold some sizes as int).
// The dtype field differs (c10::ScalarType vs the kernels' DType): the caller sets it.
#pragma once

#include <ATen/ATen.h>

#include "common/gated_activation.h"
#include "common/validation.h"

namespace pagedkv {

template <typename Field, typename Value>
void set_field(Field& field, Value value) {
  field = static_cast<Field>(value);
}

// out[t] = rms_norm(input[t]) * weight; the caller adds residual / residual_stride for the fused add.
template <typename Params>
Params rms_norm_params(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  Params p{};
  p.out = out.data_ptr();
  set_field(p.out_stride, out.stride(0));
  p.input = input.const_data_ptr();
  set_field(p.input_stride, input.stride(0));
  p.weight = weight.const_data_ptr();
  set_field(p.num_tokens, input.size(0));
  set_field(p.hidden_size, input.size(1));
  p.epsilon = static_cast<float>(epsilon);
  return p;
}

// out[t] = act(gate[t]) * up[t], input[t] = [gate | up].
template <typename Params>
Params act_and_mul_params(const at::Tensor& out, const at::Tensor& input, GatedActivation activation) {
  Params p{};
  p.activation = activation;
  p.out = out.data_ptr();
  set_field(p.out_stride, out.stride(0));
  p.input = input.const_data_ptr();
  set_field(p.input_stride, input.stride(0));
  set_field(p.num_tokens, input.size(0));
  set_field(p.d, input.size(1) / 2);
  return p;
}

// RoPE on query and key in place, then key and value into their cache slots; `c` from
// check_rotary_cache_inputs.
template <typename Params>
Params rotary_cache_params(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& value,
                           at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& cos_sin_cache, bool is_neox, const CacheDims& c) {
  Params p{};
  p.positions = positions.data_ptr<int64_t>();
  p.query = query.data_ptr();
  set_field(p.query_stride_token, query.stride(0));
  set_field(p.query_stride_head, query.stride(1));
  p.key = key.data_ptr();
  set_field(p.key_stride_token, key.stride(0));
  set_field(p.key_stride_head, key.stride(1));
  p.value = value.const_data_ptr();
  set_field(p.value_stride_token, value.stride(0));
  set_field(p.value_stride_head, value.stride(1));
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  set_field(p.max_position, cos_sin_cache.size(0));
  set_field(p.rot_dim, cos_sin_cache.size(1));
  set_field(p.num_tokens, key.size(0));
  set_field(p.num_heads, query.size(1));
  set_field(p.num_kv_heads, c.num_kv_heads);
  set_field(p.head_size, c.head_size);
  set_field(p.num_slots, c.num_blocks * c.block_size);
  p.is_neox = is_neox;
  return p;
}

}  // namespace pagedkv
