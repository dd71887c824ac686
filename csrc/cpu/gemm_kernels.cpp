// The CPU linear layer on packed weights (layout in gemm_kernels.h), compiled once per
// CPU_CAPABILITY. A task owns one panel of 48 output features and a block of input
// rows; it walks the panel's K rows (as kStreams segments side by side, see there),
// several input rows at a time with their sums in registers (8 x 48 on AVX-512, 4 x 24
// on AVX2, whose last 1-2 rows take all 48: see max_tile_rows and tile_vectors), so each
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
// bench/results/cpu_linear_kernels_*avx2_cpu.md). On CPUs with AMX, oneDNN's bf16 GEMM runs on
// tiles and this loop fell to 0.12-0.34x of it from 32 rows: there bf16 products of 2 rows or
// more run on AMX tiles from the same panels (gemm_amx.cpp, chosen in gemm.cpp).
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

// The chunk of a product of `rows` input rows. fp32 on AVX-512 with 2-8 row tiles (decode's
// batches) takes 128 rows in L1 too: its later row tiles read the chunk 1.07-1.13x faster
// from there, while the next chunk comes into L2 under them (see run_task): 27 rows 32-34 ->
// 29.5-30.7 ms on the default model's layer GEMMs; at 257-512 rows the two sizes were within
// the noise (Xeon, 2026-12-06, alternated builds).
template <typename T>
constexpr int64_t chunk_rows_for(int64_t rows) {
#if !defined(CPU_CAPABILITY_AVX2)
  if (std::is_same_v<T, float> && rows > max_tile_rows<T>() && rows <= 64) return 128;
#endif
  return chunk_rows<T>();
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

// The order of a panel's K rows. A product of a tile of rows or fewer (decode's, an
// expert's few rows in fused_moe) reads each weight for one tile only, so its speed is the
// rate it reads the panel at, and a core reads faster the more streams it has open (one
// thread, Zen 3, 2026-12-05: 22 GB/s from one stream, 29 from two, 33 from four, 31 from
// eight). Its panel rows split into kStreams equal segments, walked side by side, a row of
// each in turn into the same sums, then the few rows left over (and bf16's lone last pair) in
// order: 1.1-1.4x the single stream's rate at 1-4 rows on one or two threads. Larger
// products are bound by the FMAs and walk the rows in order: there the segments' pointers
// spilled the 4-row tiles' registers and ran prefill's products 3-7% slower.
// So the summation order is one per regime: a row's bits can differ between a product of
// few rows and one of many (as with oneDNN's), and, at 2-8 rows, between CPU variants whose
// tiles hold different row counts; products of more rows sum alike on every variant.
constexpr int kStreams = 4;

// Products of at most this many rows read their panels in kStreams segments: fp32 up to a
// whole tile (2 threads: 1.31x at 1 row, 1.25x at 4); bf16 one row (1.13-1.19x), its 2-4-row
// tiles, a third of a panel row wide and holding widened weights, ran 0.92-1.0x in segments.
template <typename T>
constexpr int64_t max_streamed_rows() {
  return std::is_same_v<T, float> ? max_tile_rows<T>() : 1;
}

// One register tile's pass over part of the panel: `steps` rows (of G panel rows each) of
// NSEG segments, segment s's rows w_seg elements after segment 0's in the weights and
// x_seg after them in the inputs.
template <typename T>
struct TileJob {
  const T* x;          // the tile's first input row
  int64_t x_stride;
  const T* panel;      // segment 0's first panel row of the pass, at the tile's first column
  int64_t steps;       // rows of each segment in the pass, in steps of G panel rows
  int64_t w_seg;       // weight elements from a segment's row to the next segment's
  int64_t x_seg;       // input index from a segment's row to the next segment's (panel rows)
  int64_t xj0;         // input index (panel row) of segment 0's first row
  bool lone_last;      // bf16 with K odd, in the tail pass: the pass's last row is a half pair
  const float* carry;  // [R][48] partial sums of the earlier passes (at the tile's first column), or nullptr
  float* sums;         // [R][48] where the sums go (likewise)
  const float* xf;     // widened_input: the tile's first input row in fp32 (pairs padded to even), else unused
  int64_t xf_stride;
  const char* prefetch = nullptr;  // rows in order: cache lines to bring into L2 while this tile computes
  int64_t prefetch_lines = 0;      // (its share of the weights the task reads next, see run_task)
};

// NSEG: kStreams for the segments of a few-row product, 1 for rows in order. G: panel rows per
// step of a segment, 2 for the fp32 tiles over a widened bf16 panel, whose pair j is rows 2j and
// 2j + 1 (so the sums take a pair's two products in a row, as the pair tiles do).
template <typename T, int R, int NSEG, int G>
void run_tile_columns(const TileJob<T>& job) {
  constexpr int64_t kRowLen = kPanelWidth * kPerRow<T>;
  Tile<T, R> tile;
  tile.load(job.carry);
  const T* w[NSEG];
  int64_t xj[NSEG];
  for (int s = 0; s < NSEG; ++s) {
    w[s] = job.panel + s * job.w_seg;
    xj[s] = job.xj0 + s * job.x_seg;
  }
  if constexpr (widened_input<T>()) {
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = job.xf + r * job.xf_stride;
    // The widened inputs are padded to whole pairs: a lone half pair runs as a whole one.
    const int64_t steps = job.steps + (job.lone_last ? 1 : 0);
    if constexpr (NSEG == 1) {
      const T* wr = job.panel;
      for (int64_t j = job.xj0; j < job.xj0 + steps; ++j, wr += kRowLen) tile.step_widened(wr, xr, j);
      tile.store(job.sums);
      return;
    }
    for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 4
      for (int s = 0; s < NSEG; ++s) {
        tile.step_widened(w[s], xr, xj[s]);
        w[s] += kRowLen;
        ++xj[s];
      }
    }
    tile.store(job.sums);
    return;
  }
  XOperand<T> x[R];
  if constexpr (NSEG == 1) {
    // Rows in order: one pointer and one index, as few registers as the tile leaves.
    const T* wr = job.panel;
    const int64_t end = job.xj0 + job.steps * G;
    const char* pf = job.prefetch;
    int64_t pf_left = job.prefetch_lines;
    for (int64_t j = job.xj0; j < end; ++j, wr += kRowLen) {
      if (pf_left > 0) {  // a line a step: the read overlaps the FMAs instead of waiting before them
        __builtin_prefetch(pf, 0, 2);
        pf += 64;
        --pf_left;
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) x[r] = x_operand(job.x + r * job.x_stride, j, false);
      tile.step(wr, x);
    }
    if (job.lone_last) {
      for (int r = 0; r < R; ++r) x[r] = x_operand(job.x + r * job.x_stride, end, true);
      tile.step(wr, x);
    }
    tile.store(job.sums);
    return;
  }
  for (int64_t i = 0; i < job.steps; ++i) {
#pragma GCC unroll 4
    for (int s = 0; s < NSEG; ++s) {
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g, w[s] += kRowLen, ++xj[s]) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) x[r] = x_operand(job.x + r * job.x_stride, xj[s], false);
        tile.step(w[s], x);
      }
    }
  }
  tile.store(job.sums);  // the lone half pair is always in the tail, which runs in order
}

// The tiles of R rows across the panel's 48 columns, a tile's width at a time; job at column 0.
// Kept out of line: inlined into the task loop, the 4-row tiles lost a held weight vector to
// the loop's registers and read it from L1 at every FMA (bf16's prefill products 0.85x).
template <typename T, int R, int NSEG, int G>
__attribute__((noinline)) void run_tile(const TileJob<T>& job) {
  constexpr int64_t width = Tile<T, R>::kTV * kW;
  static_assert(kPanelWidth % width == 0, "tiles cover the panel row");
  for (int64_t col = 0; col < kPanelWidth; col += width) {
    TileJob<T> part = job;
    part.panel += col * kPerRow<T>;
    if (part.carry) part.carry += col;
    part.sums += col;
    run_tile_columns<T, R, NSEG, G>(part);
  }
}

// run_tile<T, rows, NSEG, G> for 1 <= rows <= R.
template <typename T, int R, int NSEG, int G>
void run_tile_rows(int rows, const TileJob<T>& job) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile_rows<T, R - 1, NSEG, G>(rows, job);
  }
  run_tile<T, R, NSEG, G>(job);
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

// The passes of a task over one panel (see kStreams): the segments a piece at a time (each
// pass kChunk rows, kChunk / streams of each segment, kept in cache while every row tile of
// the task passes over them), then the tail. Rows are panel rows: fp32 rows or bf16 pairs.
// With one stream the single segment is every row but bf16's lone half pair.
struct PanelPasses {
  int64_t streams;     // kStreams (a product of at most one tile of rows) or 1
  int64_t seg;         // rows per segment
  int64_t tail0;       // streams * seg: the tail's first row
  int64_t rows;        // the panel's rows
  bool odd_pairs;      // bf16 with K odd: the last row is a lone half pair (always in the tail)
  int64_t piece;       // segment rows per pass
  int64_t seg_passes;  // passes over the segments
  int64_t count;       // passes in all: seg_passes, plus one for a tail

  PanelPasses(int64_t panel_rows, bool odd, int64_t chunk, int64_t num_streams)
      : streams(num_streams), seg((panel_rows - odd) / streams), tail0(streams * seg), rows(panel_rows),
        odd_pairs(odd), piece(chunk / streams), seg_passes((seg + piece - 1) / piece),
        count(seg_passes + (tail0 < rows)) {}
};

// One product of a batch: its passes, its tasks and, for widened_input, its rows in fp32.
template <typename T>
struct Problem {
  const PackedLinearParams* p;
  PanelPasses passes;
  TaskGrid grid;
  int64_t first_task;  // its first task's index among the batch's
  float* xf;           // widened_input: [M][xf_stride] fp32 rows, K padded to whole pairs with zeros
  int64_t xf_stride;
};

// Estimated cost of a task of `rows` input rows over a panel of `panel_rows` rows: reading
// the panel weighs as much as ~10 rows of FMAs (decode's 1-4-row products are bound by the
// read, 64-row ones by the FMAs at ~6x the read's time; Zen 3, 2026-12-05).
inline int64_t task_cost(int64_t rows, int64_t panel_rows) { return panel_rows * (rows + 10); }

// The batch's tasks cut into `parts` contiguous runs of about equal cost: bounds[i] is run i's
// first task (bounds has parts + 1 entries).
template <typename T>
std::vector<int64_t> balanced_runs(const std::vector<Problem<T>>& problems, int64_t num_tasks, int64_t parts) {
  std::vector<int64_t> cost_before(num_tasks + 1, 0);
  for (const Problem<T>& pr : problems) {
    for (int64_t t = 0; t < pr.grid.panels * pr.grid.row_blocks; ++t) {
      const int64_t m0 = (t / pr.grid.panels) * pr.grid.row_block;
      const int64_t rows = std::min(pr.p->M, m0 + pr.grid.row_block) - m0;
      const int64_t i = pr.first_task + t;
      cost_before[i + 1] = cost_before[i] + task_cost(rows, pr.passes.rows);
    }
  }
  return equal_cost_runs(cost_before, parts);
}

// Task t of one product: panel t % panels over row block t / panels.
template <typename T>
void run_task(const Problem<T>& pr, int64_t t, std::vector<float>& scratch, std::vector<float>& panel_f) {
  constexpr int kRows = max_tile_rows<T>();
  constexpr int64_t kRowLen = kPanelWidth * kPerRow<T>;
  const PackedLinearParams& p = *pr.p;
  const PanelPasses& passes = pr.passes;
  const T* input = static_cast<const T*>(p.input);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const bool chunked = passes.count > 1;
  const int64_t panel = t % pr.grid.panels, m0 = (t / pr.grid.panels) * pr.grid.row_block;
  const int64_t m1 = std::min(p.M, m0 + pr.grid.row_block);
  const int64_t n0 = panel * kPanelWidth, n = std::min(kPanelWidth, p.N - n0);
  const bool widened_panel = widened_input<T>() && m1 - m0 >= kWidenedPanelRows;
  alignas(64) float bias_f[kPanelWidth];
  for (int64_t c = 0; c < kPanelWidth; ++c) bias_f[c] = bias && c < n ? static_cast<float>(bias[n0 + c]) : 0.f;
  const T* panel_base = static_cast<const T*>(p.weight) + panel * passes.rows * kRowLen;
  for (int64_t pass = 0; pass < passes.count; ++pass) {
    const bool tail = pass == passes.seg_passes, first = pass == 0, last = pass + 1 == passes.count;
    // The pass's first row of segment 0 and its rows per segment (the tail: one segment).
    const int64_t j0 = tail ? passes.tail0 : pass * passes.piece;
    const int64_t steps = tail ? passes.rows - passes.tail0 : std::min(passes.piece, passes.seg - j0);
    const int num_segments = tail ? 1 : static_cast<int>(passes.streams);
    const bool in_order = num_segments == 1;
    if constexpr (widened_input<T>()) {
      if (widened_panel) {
        for (int s = 0; s < num_segments; ++s) {
          widen_pairs(panel_base + (j0 + s * passes.seg) * kRowLen, steps, panel_f.data() + s * steps * 2 * kPanelWidth);
        }
      }
    }
    // With several row tiles, the first reads the pass from memory and the others from L2, bound
    // by their FMAs: they also bring in the weights that follow the pass in memory (the next
    // pass, or the next panel, which the next task takes), so that the read runs under the
    // FMAs rather than before them. fp32 at 27 rows had run as if the two took turns (the
    // default model's layer GEMMs, cold weights: 1.32x at 27 rows, 1.19x at 48, prefill's
    // unchanged; Xeon, 2026-12-06). Not on the AMX tiles: there the same prefetch of the next
    // panel slowed 2-128 rows 1.05-1.25x, the tiles being bound by the read alone.
    const char* next_bytes = reinterpret_cast<const char*>(panel_base + (j0 + steps) * kRowLen);
    const int64_t prefetch_lines =
        m1 - m0 > kRows ? passes.piece * passes.streams * kRowLen * static_cast<int64_t>(sizeof(T)) / 64 : 0;
    for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
      float* tile_sums = scratch.data() + (chunked ? (r0 - m0) * kPanelWidth : 0);
      const float* carry = first ? nullptr : tile_sums;
      if (widened_panel) {
        // fp32 tiles over the widened pass: segment s's pairs are 2 * steps rows of panel_f, its
        // inputs the fp32 elements from 2 (j0 + s * seg); the lone half pair is whole, its zeros padded.
        const TileJob<float> job{pr.xf + r0 * pr.xf_stride, pr.xf_stride, panel_f.data(), steps,
                                 2 * steps * kPanelWidth, 2 * passes.seg, 2 * j0, false, carry, tile_sums, nullptr, 0};
        if (in_order) {
          run_tile_rows<float, max_tile_rows<float>(), 1, 2>(rows, job);
        } else {
          run_tile_rows<float, max_tile_rows<float>(), kStreams, 2>(rows, job);
        }
      } else {
        const bool lone = tail && passes.odd_pairs;
        TileJob<T> job{input + r0 * p.input_stride, p.input_stride, panel_base + j0 * kRowLen, steps - lone,
                       passes.seg * kRowLen, passes.seg, j0, lone, carry, tile_sums,
                       pr.xf + r0 * pr.xf_stride, pr.xf_stride};
        if (in_order && prefetch_lines > 0) {
          // Row tile i of n brings in lines [i L / n, (i + 1) L / n) of what follows this pass.
          const int64_t tile_i = (r0 - m0) / kRows, n_tiles = (m1 - m0 + kRows - 1) / kRows;
          const int64_t first = tile_i * prefetch_lines / n_tiles, next = (tile_i + 1) * prefetch_lines / n_tiles;
          job.prefetch = next_bytes + first * 64;
          job.prefetch_lines = next - first;
        }
        if (in_order) {
          run_tile_rows<T, kRows, 1, 1>(rows, job);
        } else {
          run_tile_rows<T, kRows, kStreams, 1>(rows, job);
        }
      }
      if (last) store_rows(tile_sums, bias_f, rows, n, out + r0 * p.out_stride + n0, p.out_stride);
    }
  }
}

template <typename T>
void packed_linear_impl(const PackedLinearBatch& batch) {
  constexpr int kRows = max_tile_rows<T>();
  constexpr int64_t kChunk = chunk_rows<T>();
  static_assert(max_tile_rows<float>() >= kRows, "a widened panel's fp32 tiles take a tile's rows");
  static_assert(kChunk % kStreams == 0, "a pass takes as many rows of every segment");
  std::vector<Problem<T>> problems;
  problems.reserve(batch.count);
  int64_t num_tasks = 0, xf_size = 0, scratch_rows = kRows;
  std::vector<int64_t> rows_before{0};  // input rows of the problems before each
  for (int64_t i = 0; i < batch.count; ++i) {
    const PackedLinearParams& p = batch.problems[i];
    if (p.M == 0 || p.N == 0) continue;
    const int64_t streams = p.M <= max_streamed_rows<T>() ? kStreams : 1;
    const PanelPasses passes((p.K + kPerRow<T> - 1) / kPerRow<T>, kPerRow<T> == 2 && p.K % 2 == 1,
                             chunk_rows_for<T>(p.M), streams);
    const TaskGrid grid = task_grid(p.M, p.N);
    const int64_t xf_stride = widened_input<T>() ? 2 * passes.rows : 0;
    problems.push_back({&p, passes, grid, num_tasks, nullptr, xf_stride});
    num_tasks += grid.panels * grid.row_blocks;
    xf_size += p.M * xf_stride;
    rows_before.push_back(rows_before.back() + p.M);
    if (passes.count > 1) scratch_rows = std::max(scratch_rows, grid.row_block);
  }
  if (problems.empty()) return;
  std::vector<float> xf(static_cast<size_t>(xf_size));
  if constexpr (widened_input<T>()) {
    float* next = xf.data();
    for (Problem<T>& pr : problems) {
      pr.xf = next;
      next += pr.p->M * pr.xf_stride;
    }
    // Every input row of every problem, widened once.
    at::parallel_for(0, rows_before.back(), 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const size_t i = std::upper_bound(rows_before.begin(), rows_before.end(), r) - rows_before.begin() - 1;
        const Problem<T>& pr = problems[i];
        const int64_t m = r - rows_before[i];
        at::vec::convert(static_cast<const T*>(pr.p->input) + m * pr.p->input_stride, pr.xf + m * pr.xf_stride,
                         pr.p->K);
        std::fill(pr.xf + m * pr.xf_stride + pr.p->K, pr.xf + (m + 1) * pr.xf_stride, 0.f);
      }
    });
  }
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const std::vector<int64_t> bounds = balanced_runs(problems, num_tasks, threads);
  at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scratch(static_cast<size_t>(scratch_rows * kPanelWidth));
    std::vector<float> panel_f(widened_input<T>() ? static_cast<size_t>(2 * kChunk * kStreams * kPanelWidth) : 0);
    size_t i = 0;
    for (int64_t t = bounds[w0]; t < bounds[w1]; ++t) {
      while (i + 1 < problems.size() && problems[i + 1].first_task <= t) ++i;
      run_task(problems[i], t - problems[i].first_task, scratch, panel_f);
    }
  });
}

}  // namespace

void packed_linear(const PackedLinearBatch& batch) {
  if (batch.count == 0) return;
  const c10::ScalarType dtype = batch.problems[0].dtype;
  for (int64_t i = 1; i < batch.count; ++i) {
    TORCH_CHECK(batch.problems[i].dtype == dtype, "packed_linear: a batch's products must share one dtype, got ",
                dtype, " and ", batch.problems[i].dtype);
  }
  switch (dtype) {
    case c10::ScalarType::Float:
      return packed_linear_impl<float>(batch);
    case c10::ScalarType::BFloat16:
      return packed_linear_impl<BFloat16>(batch);
    default:
      TORCH_CHECK(false, "packed_linear: expected float32 or bfloat16, got ", dtype);
  }
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
