// CPU kernels of the fused per-layer ops (RMSNorm with the residual add, RoPE with
// the KV-cache write, the MLP's gated activation): raw-pointer parameter blocks and
// the per-capability entry points. fused_kernels.cpp is compiled once per
// instruction set, like attention_kernels.cpp; csrc/cpu/fused.cpp validates the
// tensors, fills these structs and calls the variant picked by cpu_capability.h.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/gated_activation.h"

namespace pagedkv::cpu {

// out[t] = rms_norm(z[t]) * weight, z = input (+ residual, written back to residual).
// Rows are dense along hidden; the strides (elements) are between rows.
struct RmsNormParams {
  c10::ScalarType dtype;
  void* out;
  int64_t out_stride;
  const void* input;
  int64_t input_stride;
  void* residual = nullptr;  // nullptr: plain rms_norm
  int64_t residual_stride = 0;
  const void* weight;  // [hidden_size], the input dtype
  int64_t num_tokens;
  int64_t hidden_size;
  float epsilon;
};

// RoPE on query [T, num_heads, head_size] and key [T, num_kv_heads, head_size] in
// place, then key and value into their cache slots (negative slot: skip).
struct RotaryCacheParams {
  c10::ScalarType dtype;
  const int64_t* positions;  // [num_tokens]
  void* query;
  int64_t query_stride_token, query_stride_head;
  void* key;
  int64_t key_stride_token, key_stride_head;
  const void* value;
  int64_t value_stride_token, value_stride_head;
  void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_size], contiguous
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]
  const float* cos_sin_cache;   // [max_position, rot_dim]: cos of the rot_dim/2 pairs, then sin
  int64_t max_position;
  int64_t rot_dim;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t num_slots;  // num_blocks * block_size
  bool is_neox;       // rotate-half pairs (i, i + rot_dim/2); else GPT-J pairs (2i, 2i+1)
};

// out[t] = act(gate[t]) * up[t], input[t] = [gate | up] (2 d elements); rows dense, strides
// (elements) between rows. The activation's output is rounded to the dtype before the product,
// as `act(gate).mul_(up)` in PyTorch rounds it.
struct ActAndMulParams {
  c10::ScalarType dtype;
  GatedActivation activation;
  void* out;
  int64_t out_stride;
  const void* input;
  int64_t input_stride;
  int64_t num_tokens;
  int64_t d;
};

#define PAGEDKV_DECLARE_CPU_FUSED_KERNELS(capability)          \
  namespace capability {                                      \
  void rms_norm(const RmsNormParams& params);                 \
  void rotary_embedding_and_cache(const RotaryCacheParams& params); \
  void act_and_mul(const ActAndMulParams& params);            \
  }

PAGEDKV_DECLARE_CPU_FUSED_KERNELS(DEFAULT)
PAGEDKV_DECLARE_CPU_FUSED_KERNELS(AVX2)
PAGEDKV_DECLARE_CPU_FUSED_KERNELS(AVX512)

#undef PAGEDKV_DECLARE_CPU_FUSED_KERNELS

}  // namespace pagedkv::cpu
