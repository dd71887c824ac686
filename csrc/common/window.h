// The sliding-window rule, in one place for the index checks (common/validation.cpp),
// the CPU kernels and the CUDA kernels: a key (or block) the checks skip is one no
// kernel reads. Plain C++ (no torch headers), usable in device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PAGEDKV_HOST_DEVICE __host__ __device__
#else
#define PAGEDKV_HOST_DEVICE
#endif

namespace pagedkv {

// The first key position a query at `query_pos` attends to: query_pos - sliding_window + 1
// (never below 0), or 0 without a window (sliding_window 0). HF transformers' convention
// (Mistral, Gemma 2): a window of W keys, the query's own position included.
PAGEDKV_HOST_DEVICE inline int64_t window_first_key(int64_t query_pos, int64_t sliding_window) {
  // Compared first, so that a huge window cannot overflow the subtraction.
  if (sliding_window <= 0 || sliding_window > query_pos) return 0;
  return query_pos - sliding_window + 1;
}

}  // namespace pagedkv
