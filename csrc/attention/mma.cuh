// Tensor-core and async-copy primitives of the prefill kernel, as small wrappers
// over PTX. Under the host emulation (scripts/cuda_emulation/emu.h defines
// PAGEDKV_CUDA_EMULATION) each wrapper calls an emulated instruction with the
// same per-lane register contract, so the kernel's fragment bookkeeping is
// checked on a machine without a GPU.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (PTX ISA, "Matrix fragments
// for mma.m16n8k16"), per lane with g = lane / 4, t = lane % 4; each 32-bit
// register holds two consecutive 16-bit elements, the lower index in the low half:
//   A (16 x 16, row-major): a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]
//                           a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k x n):      b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8, fp32):    c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
// Note that the C layout of two adjacent n-tiles is the A layout of one k-step:
// the probabilities P of S = Q K^T feed P V without going through shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention/attention_utils.cuh"

namespace pagedkv::cuda {

// D += A B for one m16n8k16 tile; T = __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef PAGEDKV_CUDA_EMULATION
  emu::mma_m16n8k16(d, a, b, std::is_same_v<T, __nv_bfloat16>);
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// Two fp32 values rounded to T and packed low/high into one register.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T l = from_float<T>(lo);
  const T h = from_float<T>(hi);
  uint16_t bits[2];
  memcpy(&bits[0], &l, 2);
  memcpy(&bits[1], &h, 2);
  return uint32_t(bits[0]) | (uint32_t(bits[1]) << 16);
}

// Two 16-bit values at p[0], p[stride] (shared memory) packed low/high.
template <typename T>
__device__ __forceinline__ uint32_t pack2_strided(const T* p, int stride) {
  uint16_t lo;
  uint16_t hi;
  memcpy(&lo, p, 2);
  memcpy(&hi, p + stride, 2);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// 16-byte global->shared copy that bypasses registers (and L1); zero-fills the
// destination when !valid (src is then not read, but must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef PAGEDKV_CUDA_EMULATION
  if (valid) {
    memcpy(smem, gmem, 16);
  } else {
    memset(smem, 0, 16);
  }
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifndef PAGEDKV_CUDA_EMULATION
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef PAGEDKV_CUDA_EMULATION
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

}  // namespace pagedkv::cuda
