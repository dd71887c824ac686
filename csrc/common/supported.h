// The instantiated kernel set: one place, shared by the CPU and CUDA code and
// by the error messages that list what is supported.
//
// Why this set:
//  - head sizes 64..256 cover the common decoder families (SmolLM2 uses 64,
//    Llama-2/3 and Mistral 128, Phi-2 80, GPT-J-style 256, Gemma 256); 96 and
//    112 appear in mid-sized models. Every extra head size is one more
//    template instantiation per (dtype, block size) in CUDA, so the set is
//    closed rather than "any multiple of 16".
//  - block sizes 8/16/32 are the ones vLLM users pick; 16 is the default.
//    Larger blocks waste memory in the last block, smaller ones make block
//    tables long (see README, "Choosing block_size").
//  - fp32 is kept for testing and for CPU serving; fp16/bf16 for GPUs.
#pragma once

#include <array>
#include <cstdint>

namespace pagedkv {

inline constexpr std::array<int64_t, 6> kSupportedHeadSizes = {64, 80, 96, 112, 128, 256};
inline constexpr std::array<int64_t, 3> kSupportedBlockSizes = {8, 16, 32};
inline constexpr std::array<int64_t, 3> kSupportedPartitionSizes = {256, 512, 1024};
inline constexpr int64_t kDefaultPartitionSize = 512;
inline constexpr const char* kSupportedDtypes = "float32, float16, bfloat16";

template <size_t N>
constexpr bool is_one_of(int64_t value, const std::array<int64_t, N>& set) {
  for (int64_t v : set) {
    if (v == value) return true;
  }
  return false;
}

}  // namespace pagedkv
