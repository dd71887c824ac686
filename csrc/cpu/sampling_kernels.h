// The CPU kernel of `sample_from_logits`: one token per row of float32 logits, by inverting
// the row's cumulative distribution exp((logit - max) / temperature) at u times its total.
// sampling_kernels.cpp is compiled once per instruction set (DEFAULT, AVX2, AVX512; the
// AVX512_BF16 variant runs the AVX512 build), like fused_kernels.cpp; csrc/cpu/sampling.cpp
// validates the tensors, fills SampleParams and calls the variant picked by cpu_capability.h.
#pragma once

#include <cstdint>

namespace pagedkv::cpu {

struct SampleParams {
  int64_t* out;               // [num_rows]
  const float* logits;        // [num_rows, vocab], rows dense
  int64_t logits_stride;      // elements between rows
  const float* temperatures;  // [num_rows]; 0: the row's first maximum (greedy)
  const float* uniforms;      // [num_rows], in [0, 1)
  int64_t num_rows;
  int64_t vocab;
};

#define PAGEDKV_DECLARE_CPU_SAMPLING_KERNELS(capability) \
  namespace capability {                                 \
  void sample_from_logits(const SampleParams& params);   \
  }

PAGEDKV_DECLARE_CPU_SAMPLING_KERNELS(DEFAULT)
PAGEDKV_DECLARE_CPU_SAMPLING_KERNELS(AVX2)
PAGEDKV_DECLARE_CPU_SAMPLING_KERNELS(AVX512)

#undef PAGEDKV_DECLARE_CPU_SAMPLING_KERNELS

}  // namespace pagedkv::cpu
