// The CPU linear layer on packed weights (layout in gemm_kernels.h), compiled once per
// CPU_CAPABILITY. A task owns one panel of 48 output features and a block of input
// rows; it walks the panel's K rows in order, 8 input rows at a time (AVX-512) with
// the 8 x 48 sums in registers, so each weight is loaded once per 8 rows and the
// panel streams from memory once. All arithmetic in fp32; bf16 runs on vdpbf16ps
// (32 products per instruction) where the CPU has AVX512-BF16, elsewhere on its
// pairs widened to fp32 (exact: a bf16 is the top half of an fp32).
//
// Why not oneDNN: decoding multiplies a handful of rows by every weight of the model
// once per step, so the weights' read rate is the step's speed. oneDNN's packed GEMM
// read them at 16-21 GB/s for 1-8 rows where this loop reads ~30 GB/s (the box's read
// rate), and it kept ahead at every row count measured, prefill sizes included (the
// default model's 120 layer GEMMs with cold weights, interleaved, AMD Zen 4, 2026-12-03:
// bf16 1.64-1.88x at 1-8 rows, 1.32x at 27-64, 1.15x at 512; fp32 1.50-1.59x, 1.13-1.20x, 1.08x).
#include "cpu/gemm_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512_BF16)
#include <immintrin.h>
#endif

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
using c10::BFloat16;
constexpr int kW = Vec::size();
constexpr int kNV = static_cast<int>(kPanelWidth) / kW;  // vectors of a panel row
static_assert(kPanelWidth % kW == 0, "a panel row is whole vectors");

// Input elements per packed panel row: one fp32, or a pair of bf16.
template <typename T>
constexpr int64_t kPerRow = std::is_same_v<T, float> ? 1 : 2;

// Panel rows per K chunk: 96 KiB of a panel (512 rows of 48 fp32 or of 48 bf16 pairs)
// stay in L2 while every row block of the task passes over them. Only weights with
// more rows are chunked; their partial sums wait in a per-thread scratch between chunks.
constexpr int64_t kChunkRows = 512;
// Input rows per task at most: the scratch of one task is kRowBlock x 48 floats.
constexpr int64_t kRowBlock = 256;

// Input rows per register tile: as many as the registers hold beside the weights.
template <typename T>
constexpr int max_tile_rows() {
#if defined(CPU_CAPABILITY_AVX512)
  // 8 x 3 accumulators; widened bf16 needs 6 more registers for a row's even and odd weights.
#if defined(CPU_CAPABILITY_AVX512_BF16)
  return 8;
#else
  return std::is_same_v<T, float> ? 8 : 6;
#endif
#elif defined(CPU_CAPABILITY_AVX2)
  // 16 registers: 2 x 6 accumulators (fp32), or 1 x 6 beside the widened pairs (bf16).
  return std::is_same_v<T, float> ? 2 : 1;
#else
  return 1;
#endif
}

// An input row's operand for one panel row: its fp32 element, or its pair of bf16 as one word.
template <typename T>
using XOperand = std::conditional_t<std::is_same_v<T, float>, float, uint32_t>;

// The operand of panel row j of input row x; `lone`: the row's last bf16 of an odd K, its pair's
// second element zero (the packed weight is zero there too, and x has no element to read).
template <typename T>
inline XOperand<T> x_operand(const T* x, int64_t j, bool lone) {
  if constexpr (std::is_same_v<T, float>) {
    return x[j];
  } else {
    uint16_t lo;
    std::memcpy(&lo, x + 2 * j, sizeof(lo));
    if (lone) return lo;
    uint32_t pair;
    std::memcpy(&pair, x + 2 * j, sizeof(pair));
    return pair;
  }
}

// R input rows x 48 outputs of fp32 sums, in registers.
template <typename T, int R>
struct Tile {
  Vec acc[R][kNV];

  void load(const float* src) {  // src [R][48], or nullptr: zero
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNV; ++v) acc[r][v] = src ? Vec::loadu(src + r * kPanelWidth + v * kW) : Vec(0.f);
  }

  void store(float* dst) const {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNV; ++v) acc[r][v].store(dst + r * kPanelWidth + v * kW);
  }

  // acc[r] += x[r] * w for one panel row w (48 weights, or 48 pairs).
  inline void step(const T* w, const XOperand<T> (&x)[R]) {
    if constexpr (std::is_same_v<T, float>) {
      Vec xs[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xs[r] = Vec(x[r]);
#pragma GCC unroll 6
      for (int v = 0; v < kNV; ++v) {
        const Vec wv = Vec::loadu(w + v * kW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][v] = at::vec::fmadd(xs[r], wv, acc[r][v]);
      }
    } else {
#if defined(CPU_CAPABILITY_AVX512_BF16)
      __m512bh wv[kNV];
#pragma GCC unroll 3
      for (int v = 0; v < kNV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 2 * kW);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r]));
#pragma GCC unroll 3
        for (int v = 0; v < kNV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
      }
#else
      // A pair word holds element 2j in its low half: as fp32, word << 16 and word & 0xFFFF0000.
      const IVec high(static_cast<int32_t>(0xFFFF0000u));
      Vec xe[R], xo[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        xe[r] = Vec(bits_to_float(x[r] << 16));
        xo[r] = Vec(bits_to_float(x[r] & 0xFFFF0000u));
      }
#pragma GCC unroll 6
      for (int v = 0; v < kNV; ++v) {
        const IVec pairs = IVec::loadu(w + v * 2 * kW);
        const Vec we = at::vec::cast<float>(pairs << IVec(16)), wo = at::vec::cast<float>(pairs & high);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][v] = at::vec::fmadd(xo[r], wo, at::vec::fmadd(xe[r], we, acc[r][v]));
      }
#endif
    }
  }

  static float bits_to_float(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
};

// One register tile's pass over panel rows [j0, j1) of one K chunk.
template <typename T>
struct TileJob {
  const T* x;          // the tile's first input row
  int64_t x_stride;
  const T* panel;      // the panel's row 0
  int64_t j0, j1;      // panel rows of the chunk
  bool lone_last;      // bf16 with K odd and j1 the panel's end: the last row's pair is half
  const float* carry;  // [R][48] partial sums of the earlier chunks, or nullptr (first chunk)
  float* sums;         // [R][48] where the sums go
};

template <typename T, int R>
void run_tile(const TileJob<T>& job) {
  Tile<T, R> tile;
  tile.load(job.carry);
  const int64_t full_end = job.lone_last ? job.j1 - 1 : job.j1;
  XOperand<T> x[R];
  const T* w = job.panel + job.j0 * kPanelWidth * kPerRow<T>;
  for (int64_t j = job.j0; j < full_end; ++j, w += kPanelWidth * kPerRow<T>) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) x[r] = x_operand(job.x + r * job.x_stride, j, false);
    tile.step(w, x);
  }
  if (job.lone_last) {
    for (int r = 0; r < R; ++r) x[r] = x_operand(job.x + r * job.x_stride, full_end, true);
    tile.step(w, x);
  }
  tile.store(job.sums);
}

// run_tile<T, rows> for 1 <= rows <= R.
template <typename T, int R>
void run_tile_rows(int rows, const TileJob<T>& job) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile_rows<T, R - 1>(rows, job);
  }
  run_tile<T, R>(job);
}

// out[r][0, n) = sums[r] + bias, rounded to T, for `rows` rows.
template <typename T>
void store_rows(const float* sums, const float* bias, int rows, int64_t n, T* out, int64_t out_stride) {
  for (int r = 0; r < rows; ++r) {
    alignas(64) float row[kPanelWidth];
    for (int v = 0; v < kNV; ++v) {
      (Vec::loadu(sums + r * kPanelWidth + v * kW) + Vec::loadu(bias + v * kW)).store(row + v * kW);
    }
    T* dst = out + r * out_stride;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, row, n * sizeof(float));
    } else {
      at::vec::convert(row, dst, n);  // round to nearest even, as oneDNN and torch round
    }
  }
}

// How the M x N product is cut into tasks: panels x blocks of input rows.
struct TaskGrid {
  int64_t panels, row_block, row_blocks;
};

// Whole rows per task unless there are few panels for the threads: then rows are split too
// (in multiples of 8, at least 64 rows a task, so each weight still serves many rows).
TaskGrid task_grid(int64_t M, int64_t N) {
  const int64_t panels = (N + kPanelWidth - 1) / kPanelWidth;
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t row_block = std::min<int64_t>(std::max<int64_t>(M, 1), kRowBlock);
  while (panels * ((M + row_block - 1) / row_block) < wanted && row_block > 64) {
    row_block = std::max<int64_t>(64, (row_block / 2 + 7) / 8 * 8);
  }
  return {panels, row_block, (M + row_block - 1) / row_block};
}

template <typename T>
void packed_linear_impl(const PackedLinearParams& p) {
  constexpr int kRows = max_tile_rows<T>();
  const T* input = static_cast<const T*>(p.input);
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const int64_t panel_rows = (p.K + kPerRow<T> - 1) / kPerRow<T>;
  const bool odd_pairs = kPerRow<T> == 2 && p.K % 2 == 1;
  const TaskGrid grid = task_grid(p.M, p.N);
  const bool chunked = panel_rows > kChunkRows;
  at::parallel_for(0, grid.panels * grid.row_blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(static_cast<size_t>((chunked ? grid.row_block : kRows) * kPanelWidth));
    alignas(64) float bias_f[kPanelWidth];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t panel = t % grid.panels, m0 = (t / grid.panels) * grid.row_block;
      const int64_t m1 = std::min(p.M, m0 + grid.row_block);
      const int64_t n0 = panel * kPanelWidth, n = std::min(kPanelWidth, p.N - n0);
      for (int64_t c = 0; c < kPanelWidth; ++c) bias_f[c] = bias && c < n ? static_cast<float>(bias[n0 + c]) : 0.f;
      const T* panel_base = weight + panel * panel_rows * kPanelWidth * kPerRow<T>;
      for (int64_t j0 = 0; j0 < panel_rows; j0 += kChunkRows) {
        const int64_t j1 = std::min(panel_rows, j0 + kChunkRows);
        const bool first = j0 == 0, last = j1 == panel_rows;
        for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
          float* tile_sums = scratch.data() + (chunked ? (r0 - m0) * kPanelWidth : 0);
          const TileJob<T> job{input + r0 * p.input_stride, p.input_stride, panel_base, j0, j1,
                               last && odd_pairs, first ? nullptr : tile_sums, tile_sums};
          run_tile_rows<T, kRows>(rows, job);
          if (last) store_rows(tile_sums, bias_f, rows, n, out + r0 * p.out_stride + n0, p.out_stride);
        }
      }
    }
  });
}

}  // namespace

void packed_linear(const PackedLinearParams& p) {
  if (p.M == 0 || p.N == 0) return;
  switch (p.dtype) {
    case c10::ScalarType::Float:
      return packed_linear_impl<float>(p);
    case c10::ScalarType::BFloat16:
      return packed_linear_impl<BFloat16>(p);
    default:
      TORCH_CHECK(false, "packed_linear: expected float32 or bfloat16, got ", p.dtype);
  }
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
