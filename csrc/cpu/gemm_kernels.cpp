// The CPU linear layer on packed weights (layout in gemm_kernels.h), compiled once per
// CPU_CAPABILITY. A task owns one panel of 48 output features and a block of input
// rows; it walks the panel's K rows in order, several input rows at a time with their
// sums in registers (8 x 48 on AVX-512, 4 x 24 on AVX2, whose last 1-2 rows take all 48:
// see max_tile_rows and tile_vectors), so each
// weight is loaded once per tile of rows and the panel streams from memory once. All
// arithmetic in fp32; bf16 runs on vdpbf16ps (32 products per instruction) where the
// CPU has AVX512-BF16, elsewhere on its pairs widened to fp32 (exact: a bf16 is the
// top half of an fp32).
//
// Why not oneDNN: decoding multiplies a handful of rows by every weight of the model
// once per step, so the weights' read rate is the step's speed. oneDNN's packed GEMM
// read them at 16-21 GB/s for 1-8 rows where this loop reads ~30 GB/s (the box's read
// rate), and it kept ahead at every row count measured, prefill sizes included (the
// default model's 120 layer GEMMs with cold weights, interleaved, AMD Zen 4, 2026-12-03:
// bf16 1.64-1.88x at 1-8 rows, 1.32x at 27-64, 1.15x at 512; fp32 1.50-1.59x, 1.13-1.20x, 1.08x;
// AVX2 AMD Zen 3, 2026-12-04, fp32: 1.2-1.4x at 4-64 rows, 1.03-1.06x at 256-512, and since
// the whole-row tiles of 1-2 rows (2026-12-05) 1.35-1.50x at 1-2 rows, where half rows gave
// 1.04x; bf16 against oneDNN's fp32 GEMM on the weights' upcast, oneDNN having no bf16 GEMM
// there: 2.1-2.4x at 1-2 rows, 1.7-2.1x at 4-16, 1.04-1.35x at 32-2048; see
// bench/results/cpu_linear_kernels_*avx2_cpu.md).
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

// Panel rows per K chunk, kept in cache while every row tile of the task passes over
// them: on AVX-512 96 KiB of a panel (512 rows of 48 fp32 or of 48 bf16 pairs) in L2; on
// AVX2 24 KiB (128 rows) in L1, since there a tile of 4 rows loads a weight vector for
// every 4 FMAs and L2 could not feed that (with 512-row chunks in L2 the 64-row product
// ran at 0.76x oneDNN, with 128 at 1.2x; Zen 3, 2026-12-04). Only weights with more rows
// are chunked; their partial sums wait in a per-thread scratch between chunks.
// bf16 on AVX2 takes half as many pairs: a chunk widened to fp32 (widened_panel) is
// 2 x 64 rows x 48 floats, the same 24 KiB.
template <typename T>
constexpr int64_t chunk_rows() {
#if defined(CPU_CAPABILITY_AVX2)
  return std::is_same_v<T, float> ? 128 : 64;
#else
  return 512;
#endif
}
// Input rows per task at most: the scratch of one task is kRowBlock x 48 floats.
constexpr int64_t kRowBlock = 256;

// The register tile: input rows x vectors of a panel row, as many as the registers
// hold beside the operands.
//   AVX-512: 8 rows x the whole row (3 vectors); 6 rows for widened bf16, whose even
//            and odd weights take 6 registers more.
//   AVX2:    fp32 4 rows x half a row (3 of its 6 vectors): 12 sums, and the 3 weight
//            vectors held while each row's broadcast passes over them, fill the 16
//            registers. Each weight serves 4 rows: 2 x 6 (each weight serving 2) ran
//            the 64- and 512-row products at 0.75x / 0.8x of this shape.
//            bf16: 4 rows x a third of a row (2 vectors of pairs, held widened as 4 fp32
//            vectors of even and odd weights, beside 8 sums and a row's 2 broadcasts;
//            see widened_input).
//   default: 1 row x the whole row.
template <typename T>
constexpr int max_tile_rows() {
#if defined(CPU_CAPABILITY_AVX512)
#if defined(CPU_CAPABILITY_AVX512_BF16)
  return 8;
#else
  return std::is_same_v<T, float> ? 8 : 6;
#endif
#elif defined(CPU_CAPABILITY_AVX2)
  return 4;
#else
  return 1;
#endif
}

template <typename T, int R>
constexpr int tile_vectors() {
#if defined(CPU_CAPABILITY_AVX2)
  // Tiles of 1 or 2 rows take wider parts of the panel row (fp32: all of it, 12 sums at
  // most, the weights streamed past the rows' broadcasts; widened bf16: all of it for one
  // row, half for two): each panel row is then read in one or two passes where narrower
  // tiles read it as two or three strided streams. Decode's 1-2-row products on large
  // weights (an expert's 7168 x 1024, fp32) read them at ~11 GB/s per thread in half rows
  // against oneDNN's ~16, and at ~17 in whole rows; the default model's layers at 1 row
  // went from 16.8 to 20.8 GB/s in fp32 and from 13.0 to 18.3 in bf16 (2 threads, Zen 3,
  // 2026-12-04 against 2026-12-05).
  if constexpr (std::is_same_v<T, float>) return R <= 2 ? kNV : kNV / 2;
  return R == 1 ? kNV : R == 2 ? kNV / 2 : kNV / 3;
#else
  return kNV;
#endif
}

// Whether a tile loads its weight vectors into registers first and then broadcasts one
// row at a time (AVX2 fp32 half-row tiles: fewer registers than sums + rows + a weight)
// rather than broadcasting every row first and streaming the weights past them.
template <typename T, int R>
constexpr bool weights_held() {
#if defined(CPU_CAPABILITY_AVX2)
  return std::is_same_v<T, float> && tile_vectors<T, R>() < kNV;
#else
  return false;
#endif
}

// Whether bf16 input rows are widened to fp32 once per call, so a tile holds its weights
// widened (even and odd elements) and broadcasts each row's pair straight from memory
// (AVX2): building the pair from its bf16 word in registers took two scalar operations
// and two shuffles per row and panel row, which ran the 32-512-row products at 0.6-0.8x
// oneDNN's fp32 GEMM on the weights' upcast.
template <typename T>
constexpr bool widened_input() {
#if defined(CPU_CAPABILITY_AVX2)
  return !std::is_same_v<T, float>;
#else
  return false;
#endif
}

// Input rows per task from which bf16 (widened_input) widens each K chunk of the panel to
// fp32 once and runs the fp32 tiles over it: the widening is paid once per chunk instead
// of once per tile of 4 rows, and the fp32 tile does 3 FMAs per broadcast where the
// widened-pair tile does 2. Below this the weights' read rate sets the speed and the
// pair tile, which reads the bf16 panel once, is ahead.
constexpr int64_t kWidenedPanelRows = 32;

// Panel rows [0, pairs) of bf16 pairs widened to fp32 rows: dst row 2j is every column's
// element 2j, row 2j + 1 its element 2j + 1; [2 pairs][48] floats.
inline void widen_pairs(const BFloat16* src, int64_t pairs, float* dst) {
  const IVec high(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t j = 0; j < pairs; ++j, src += 2 * kPanelWidth, dst += 2 * kPanelWidth) {
#pragma GCC unroll 6
    for (int v = 0; v < kNV; ++v) {
      const IVec pair = IVec::loadu(src + v * 2 * kW);
      at::vec::cast<float>(pair << IVec(16)).store(dst + v * kW);
      at::vec::cast<float>(pair & high).store(dst + kPanelWidth + v * kW);
    }
  }
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

// R input rows x tile_vectors<T, R>() vectors of outputs: fp32 sums in registers.
template <typename T, int R>
struct Tile {
  static constexpr int kTV = tile_vectors<T, R>();
  Vec acc[R][kTV];

  void load(const float* src) {  // src: rows kPanelWidth apart, or nullptr: zero
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTV; ++v) acc[r][v] = src ? Vec::loadu(src + r * kPanelWidth + v * kW) : Vec(0.f);
  }

  void store(float* dst) const {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTV; ++v) acc[r][v].store(dst + r * kPanelWidth + v * kW);
  }

  // acc[r] += x[r] * w for the tile's part w of one panel row (kTV vectors of weights, or of pairs).
  inline void step(const T* w, const XOperand<T> (&x)[R]) {
    if constexpr (weights_held<T, R>()) {
      Vec wv[kTV];
#pragma GCC unroll 6
      for (int v = 0; v < kTV; ++v) wv[v] = Vec::loadu(w + v * kW);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Vec xs(x[r]);
#pragma GCC unroll 6
        for (int v = 0; v < kTV; ++v) acc[r][v] = at::vec::fmadd(xs, wv[v], acc[r][v]);
      }
    } else if constexpr (std::is_same_v<T, float>) {
      Vec xs[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xs[r] = Vec(x[r]);
#pragma GCC unroll 6
      for (int v = 0; v < kTV; ++v) {
        const Vec wv = Vec::loadu(w + v * kW);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][v] = at::vec::fmadd(xs[r], wv, acc[r][v]);
      }
    } else {
#if defined(CPU_CAPABILITY_AVX512_BF16)
      __m512bh wv[kTV];
#pragma GCC unroll 3
      for (int v = 0; v < kTV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 2 * kW);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r]));
#pragma GCC unroll 3
        for (int v = 0; v < kTV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
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
      for (int v = 0; v < kTV; ++v) {
        const IVec pairs = IVec::loadu(w + v * 2 * kW);
        const Vec we = at::vec::cast<float>(pairs << IVec(16)), wo = at::vec::cast<float>(pairs & high);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][v] = at::vec::fmadd(xo[r], wo, at::vec::fmadd(xe[r], we, acc[r][v]));
      }
#endif
    }
  }

  // The same for bf16 weight pairs with the input rows widened to fp32 (widened_input):
  // xr[r] + 2 j is row r's pair for panel row j, broadcast straight from memory.
  inline void step_widened(const T* w, const float* const (&xr)[R], int64_t j) {
    const IVec high(static_cast<int32_t>(0xFFFF0000u));
    if constexpr (kTV == kNV) {
      // One row across the whole panel row: each vector of pairs widened and used at once
      // (6 sums, the row's 2 broadcasts and one vector's even and odd weights in registers).
      const Vec xe(xr[0][2 * j]), xo(xr[0][2 * j + 1]);
#pragma GCC unroll 6
      for (int v = 0; v < kTV; ++v) {
        const IVec pairs = IVec::loadu(w + v * 2 * kW);
        acc[0][v] = at::vec::fmadd(xo, at::vec::cast<float>(pairs & high),
                                   at::vec::fmadd(xe, at::vec::cast<float>(pairs << IVec(16)), acc[0][v]));
      }
      return;
    }
    Vec we[kTV], wo[kTV];
#pragma GCC unroll 3
    for (int v = 0; v < kTV; ++v) {
      const IVec pairs = IVec::loadu(w + v * 2 * kW);
      we[v] = at::vec::cast<float>(pairs << IVec(16));
      wo[v] = at::vec::cast<float>(pairs & high);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec xe(xr[r][2 * j]), xo(xr[r][2 * j + 1]);
#pragma GCC unroll 3
      for (int v = 0; v < kTV; ++v) acc[r][v] = at::vec::fmadd(xo, wo[v], at::vec::fmadd(xe, we[v], acc[r][v]));
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
  const T* panel;      // the panel's row 0, at the tile's first column
  int64_t j0, j1;      // panel rows of the chunk
  bool lone_last;      // bf16 with K odd and j1 the panel's end: the last row's pair is half
  const float* carry;  // [R][48] partial sums of the earlier chunks (at the tile's first column), or nullptr
  float* sums;         // [R][48] where the sums go (likewise)
  const float* xf;     // widened_input: the tile's first input row in fp32 (pairs padded to even), else unused
  int64_t xf_stride;
};

template <typename T, int R>
void run_tile_columns(const TileJob<T>& job) {
  Tile<T, R> tile;
  tile.load(job.carry);
  if constexpr (widened_input<T>()) {
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = job.xf + r * job.xf_stride;
    const T* w = job.panel + job.j0 * kPanelWidth * kPerRow<T>;
    for (int64_t j = job.j0; j < job.j1; ++j, w += kPanelWidth * kPerRow<T>) tile.step_widened(w, xr, j);
    tile.store(job.sums);
    return;
  }
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

// The tiles of R rows across the panel's 48 columns, a tile's width at a time; job at column 0.
template <typename T, int R>
void run_tile(const TileJob<T>& job) {
  constexpr int64_t width = Tile<T, R>::kTV * kW;
  static_assert(kPanelWidth % width == 0, "tiles cover the panel row");
  for (int64_t col = 0; col < kPanelWidth; col += width) {
    TileJob<T> part = job;
    part.panel += col * kPerRow<T>;
    if (part.carry) part.carry += col;
    part.sums += col;
    run_tile_columns<T, R>(part);
  }
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

// Whole rows per task up to kRowBlock, cut into row blocks of equal size (a multiple of 8
// rows), and into more blocks of at least 64 rows when there are few panels for the
// threads. Equal blocks matter: parallel_for hands each thread a contiguous run of tasks,
// and with blocks of 256 rows a 257-row product (a prefill chunk of 256 tokens beside one
// decode, the common step of a lightly loaded server) gave one thread every 256-row task
// and the other the 1-row ones: the product took twice its time.
TaskGrid task_grid(int64_t M, int64_t N) {
  const int64_t panels = (N + kPanelWidth - 1) / kPanelWidth;
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t rows = std::max<int64_t>(M, 1);
  int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  while (panels * blocks < wanted && rows / (blocks + 1) >= 64) ++blocks;
  const int64_t row_block = ((rows + blocks - 1) / blocks + 7) / 8 * 8;
  return {panels, row_block, (rows + row_block - 1) / row_block};
}

template <typename T>
void packed_linear_impl(const PackedLinearParams& p) {
  constexpr int kRows = max_tile_rows<T>();
  constexpr int64_t kChunk = chunk_rows<T>();
  static_assert(max_tile_rows<float>() >= kRows, "a widened panel's fp32 tiles take a tile's rows");
  const T* input = static_cast<const T*>(p.input);
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const int64_t panel_rows = (p.K + kPerRow<T> - 1) / kPerRow<T>;
  const bool odd_pairs = kPerRow<T> == 2 && p.K % 2 == 1;
  const TaskGrid grid = task_grid(p.M, p.N);
  const bool chunked = panel_rows > kChunk;
  // widened_input: every input row in fp32, K padded to whole pairs with zeros.
  const int64_t xf_stride = widened_input<T>() ? 2 * panel_rows : 0;
  std::vector<float> xf(static_cast<size_t>(p.M * xf_stride));
  if constexpr (widened_input<T>()) {
    at::parallel_for(0, p.M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        at::vec::convert(input + m * p.input_stride, xf.data() + m * xf_stride, p.K);
        std::fill(xf.data() + m * xf_stride + p.K, xf.data() + (m + 1) * xf_stride, 0.f);
      }
    });
  }
  at::parallel_for(0, grid.panels * grid.row_blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(static_cast<size_t>((chunked ? grid.row_block : kRows) * kPanelWidth));
    std::vector<float> panel_f(widened_input<T>() ? static_cast<size_t>(2 * kChunk * kPanelWidth) : 0);
    alignas(64) float bias_f[kPanelWidth];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t panel = t % grid.panels, m0 = (t / grid.panels) * grid.row_block;
      const int64_t m1 = std::min(p.M, m0 + grid.row_block);
      const int64_t n0 = panel * kPanelWidth, n = std::min(kPanelWidth, p.N - n0);
      const bool widened_panel = widened_input<T>() && m1 - m0 >= kWidenedPanelRows;
      for (int64_t c = 0; c < kPanelWidth; ++c) bias_f[c] = bias && c < n ? static_cast<float>(bias[n0 + c]) : 0.f;
      const T* panel_base = weight + panel * panel_rows * kPanelWidth * kPerRow<T>;
      for (int64_t j0 = 0; j0 < panel_rows; j0 += kChunk) {
        const int64_t j1 = std::min(panel_rows, j0 + kChunk);
        const bool first = j0 == 0, last = j1 == panel_rows;
        if constexpr (widened_input<T>()) {
          if (widened_panel) widen_pairs(panel_base + j0 * kPanelWidth * 2, j1 - j0, panel_f.data());
        }
        for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
          float* tile_sums = scratch.data() + (chunked ? (r0 - m0) * kPanelWidth : 0);
          if (widened_panel) {
            // fp32 tiles over the widened chunk; its K rows [2 j0, 2 j1) of the fp32 inputs.
            const TileJob<float> job{xf.data() + r0 * xf_stride + 2 * j0, xf_stride, panel_f.data(), 0, 2 * (j1 - j0),
                                     false, first ? nullptr : tile_sums, tile_sums, nullptr, 0};
            run_tile_rows<float, max_tile_rows<float>()>(rows, job);
          } else {
            const TileJob<T> job{input + r0 * p.input_stride, p.input_stride, panel_base, j0, j1, last && odd_pairs,
                                 first ? nullptr : tile_sums, tile_sums, xf.data() + r0 * xf_stride, xf_stride};
            run_tile_rows<T, kRows>(rows, job);
          }
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
