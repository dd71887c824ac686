// Launchers of the fused per-layer CUDA kernels (RMSNorm with the residual add, RoPE
// with the KV-cache write, the MLP's gated activation). Plain types only (no torch headers); the tensor handling
// and validation live in csrc/cuda/fused_cuda.cpp. Each returns cudaGetLastError()
// after its launch (cudaSuccess when there was nothing to do).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention/attention_launch.h"  // DType
#include "cache/cache_launch.h"      // KVQuantArgs
#include "common/gated_activation.h"

namespace pagedkv::cuda {

// out[t] = rms_norm(z[t]) * weight, z = input, or input + residual (written to residual).
// Rows dense along hidden; strides in elements between rows. out may be input.
struct RmsNormArgs {
  DType dtype;
  void* out;
  int64_t out_stride;
  const void* input;
  int64_t input_stride;
  void* residual;  // nullptr: plain rms_norm
  int64_t residual_stride;
  const void* weight;  // [hidden_size], the input dtype
  int64_t num_tokens;
  int hidden_size;
  float epsilon;
};

cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);

// RoPE on query/key in place, then key and value into their cache slots. Strides in elements.
struct RotaryCacheArgs {
  DType dtype;  // of query/key/value
  const int64_t* positions;  // [num_tokens]; out-of-range positions are left unrotated
  void* query;
  int64_t query_stride_token, query_stride_head;
  void* key;
  int64_t key_stride_token, key_stride_head;
  const void* value;
  int64_t value_stride_token, value_stride_head;
  void* key_cache;  // [num_blocks, block_size, num_kv_heads, X], contiguous (X: as in PagedKV)
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens], negative = skip
  const float* cos_sin_cache;   // [max_position, rot_dim]: cos of the pairs, then sin
  int64_t max_position;
  int rot_dim;
  int64_t num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int64_t num_slots;  // num_blocks * block_size: slots at or past it are skipped
  bool is_neox;
  KVQuantArgs quant;  // the rotated key and the value are stored in this format
};

cudaError_t launch_rotary_embedding_and_cache(const RotaryCacheArgs& args, cudaStream_t stream);

// out[t] = act(gate[t]) * up[t], input[t] = [gate | up]; rows dense, strides in elements.
struct ActAndMulArgs {
  DType dtype;
  GatedActivation activation;
  void* out;
  int64_t out_stride;
  const void* input;
  int64_t input_stride;
  int64_t num_tokens;
  int d;
};

cudaError_t launch_act_and_mul(const ActAndMulArgs& args, cudaStream_t stream);

}  // namespace pagedkv::cuda
