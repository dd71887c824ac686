// Host emulation of the CUDA features the pagedkv kernels use, so their logic
// (indexing, masking, partition bounds, shuffles, barriers) can be checked on a
// machine without a GPU. Every CUDA thread of a block is a std::thread;
// __syncthreads / __syncwarp are barriers and warp shuffles go through a
// per-warp exchange buffer. Blocks run one after another, so `__shared__` can be
// a function-local static. Slow: for logic checks on small shapes only. It says
// nothing about speed, and memory-model races can hide from it.
// Build with -fno-strict-aliasing: the kernels type-pun 16-byte vectors the CUDA way.
#pragma once
// Selects the emulated bodies of the PTX wrappers in csrc/attention/mma.cuh.
#define PAGEDKV_CUDA_EMULATION 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#define __global__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline

namespace emu {
struct Warp {
  std::barrier<> bar{32};
  float buf[32];
  uint32_t mma_a[32][4];  // every lane's fragments of one mma.sync
  uint32_t mma_b[32][2];
};
struct Block {
  explicit Block(int threads) : bar(threads) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<Warp>());
  }
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> smem;
};
inline thread_local Block* tl_block = nullptr;
inline thread_local dim3 tl_tid, tl_bid, tl_bdim, tl_gdim;

template <typename T>
T* dynamic_smem() {
  return reinterpret_cast<T*>(tl_block->smem.data());
}

template <typename K, typename... Args>
void launch(K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t, const Args&... args) {
  const int threads = block.x * block.y * block.z;
  Block b(threads);
  std::barrier<> between(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      tl_block = &b;
      tl_tid = dim3(t, 0, 0);
      tl_bdim = block;
      tl_gdim = grid;
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            if (t == 0) b.smem.assign(smem + 16, 0xcd);  // garbage, as on a GPU
            between.arrive_and_wait();
            tl_bid = dim3(bx, by, bz);
            kernel(args...);
            between.arrive_and_wait();
          }
    });
  }
  for (auto& th : pool) th.join();
}
}  // namespace emu

#define threadIdx (emu::tl_tid)
#define blockIdx (emu::tl_bid)
#define blockDim (emu::tl_bdim)
#define gridDim (emu::tl_gdim)

namespace emu {
// One 16-bit element of a packed register as fp32.
inline float half_bits_to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
inline uint16_t element(uint32_t reg, int k) { return uint16_t(k & 1 ? reg >> 16 : reg & 0xffffu); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.f32: the whole warp calls it; every
// lane publishes its A/B registers, then computes its own four D elements from the
// fragment layout of the PTX ISA (see csrc/attention/mma.cuh), accumulating in fp32.
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf16) {
  Warp& w = *tl_block->warps[tl_tid.x / 32];
  const int lane = tl_tid.x % 32;
  for (int i = 0; i < 4; ++i) w.mma_a[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) w.mma_b[lane][i] = b[i];
  w.bar.arrive_and_wait();
  // A[row][k] lives in lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 * (k >= 8).
  auto A = [&](int row, int k) {
    return half_bits_to_float(element(w.mma_a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k), bf16);
  };
  // B[k][n] lives in lane n * 4 + (k % 8) / 2, register (k >= 8).
  auto B = [&](int k, int n) { return half_bits_to_float(element(w.mma_b[n * 4 + (k % 8) / 2][k >= 8], k), bf16); };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
    d[i] = acc;
  }
  w.bar.arrive_and_wait();  // the exchange buffer is reused by the next call
}
}  // namespace emu

inline void __syncthreads() { emu::tl_block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::tl_block->warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  emu::Warp& w = *emu::tl_block->warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  w.buf[lane] = x;
  w.bar.arrive_and_wait();
  const float r = w.buf[lane ^ o];
  w.bar.arrive_and_wait();
  return r;
}
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
// IEEE round-to-nearest single-precision ops (the quantizing cache writers); the host's
// float arithmetic is exactly that with -O2 and no -ffast-math (no FMA contraction on x86-64
// without -march flags).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.f / a; }
using std::max;
using std::min;

#define cudaGetLastError() cudaSuccess
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaGetDevice(p) (*(p) = 0, cudaSuccess)
