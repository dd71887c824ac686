// The bf16 linear layer on AMX tiles (CPUs with AMX-BF16: Intel Sapphire Rapids and
// later), for products of kAmxMinRows input rows or more. Compiled only into the
// AVX512_BF16 variant, with -mamx-tile -mamx-bf16 (CMakeLists.txt); it runs only where
// cpu_amx_enabled() (csrc/cpu/cpu_capability.h) says the CPU has the tiles and Linux has
// granted this process their state.
//
// Why tiles: a tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32
// sums, 16x the products of one vdpbf16ps. The register-tile loop of gemm_kernels.cpp runs
// the default model's layer GEMMs at ~190 GFLOP/s on two cores of such a CPU, oneDNN's
// AMX GEMM at ~1600, so without tiles prefill and batched decode there ran at 0.12-0.34x
// oneDNN, and the offline bf16 workload took 2.7x as long (Xeon with AMX, 2 cores,
// 2026-12-05; bench/results/cpu_linear_kernels_bf16_amx_cpu.md).
//
// The packed bf16 panel (gemm_kernels.h) is already the layout a B tile takes: a panel row
// is the pairs (W[n, 2j], W[n, 2j + 1]) of 48 features, 192 bytes, so 16 panel rows x 16
// features load as one tile at a 192-byte stride, and a panel is three column tiles side
// by side. One packing serves both loops: the register tiles below kAmxMinRows rows (few
// rows read the weights once and are bound by the read, where they are ahead), the AMX
// tiles from there on.
//
// A task (a panel over a block of rows) takes its rows 16 at a time (row_tile). The sums
// stay in tiles across the whole K (no partial sums in memory); the panel is read from
// memory once per task and from L2 by its later row tiles. Against oneDNN on the default
// model's layer GEMMs: 1.2-1.3x at 2-32 rows, level at 64-512, 0.75x at 2048, where oneDNN
// reaches ~2.4 TFLOP/s on two cores and this loop ~1.8.
#include "cpu/gemm_kernels.h"

#include "cpu/amx_tiles.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

using c10::BFloat16;

constexpr int64_t kTileM = 16;                 // input rows of an A tile (and of the sums)
constexpr int64_t kTileK = 32;                 // inputs per A tile row: 64 bytes of bf16
constexpr int64_t kTilePairs = kTileK / 2;     // panel rows (weight pairs) per B tile
constexpr int64_t kTileN = 16;                 // output features per sum tile
constexpr int64_t kPairBytes = 2 * sizeof(BFloat16);
constexpr int64_t kPanelRowBytes = kPanelWidth * kPairBytes;  // 192
constexpr int64_t kTileStepBytes = kTilePairs * kPanelRowBytes;
static_assert(kPanelWidth == 3 * kTileN, "a panel is three column tiles (tmm4-6, sums tmm0-2)");

// Input rows per task at most: a task is one panel over a block of row tiles.
constexpr int64_t kAmxRowBlock = 256;

// One product of the batch: where its A tiles come from and its tasks.
struct AmxProblem {
  const PackedLinearParams* p;
  int64_t pairs;         // panel rows: ceil(K / 2)
  int64_t k_steps;       // ceil(pairs / 16): A and B tiles along K
  int64_t padded_from;   // first input row read from `padded` (rows before it straight from the input)
  const BFloat16* padded;  // rows [padded_from, M) zero-padded to 16-row tiles and k_steps x 32 inputs
  int64_t padded_stride;   // elements: k_steps * 32
  int64_t panels, row_block, row_blocks;
  int64_t first_task;
};

// The input rows a tile cannot read in place, copied with zeros around them: every row when
// K is not a multiple of 32 (a tile row is 32 inputs), else only the last, partial row tile.
// The zeros multiply the panel's padding (its zero pair halves and the zero rows of the tail
// B tile), so they add nothing.
void pad_input(AmxProblem& pr, std::vector<BFloat16>& storage) {
  const PackedLinearParams& p = *pr.p;
  pr.padded_stride = pr.k_steps * kTileK;
  pr.padded_from = p.K % kTileK == 0 ? p.M / kTileM * kTileM : 0;
  const int64_t rows = (p.M - pr.padded_from + kTileM - 1) / kTileM * kTileM;
  if (rows == 0) return;
  storage.assign(rows * pr.padded_stride, BFloat16(0.f));
  const BFloat16* input = static_cast<const BFloat16*>(p.input);
  for (int64_t m = pr.padded_from; m < p.M; ++m) {
    std::memcpy(storage.data() + (m - pr.padded_from) * pr.padded_stride, input + m * p.input_stride,
                p.K * sizeof(BFloat16));
  }
  pr.padded = storage.data();
}

// out[r][0, n) = sums[r] + bias rounded to bf16 (round to nearest even, as torch and oneDNN
// round) for `rows` rows; sums and bias 48 wide.
void store_rows(const float* sums, const float* bias, int64_t rows, int64_t n, BFloat16* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kPanelWidth; c += kTileN) {
      if (c >= n) break;
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + r * kPanelWidth + c), _mm512_loadu_ps(bias + c));
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      const __mmask16 mask = n - c >= kTileN ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
      _mm256_mask_storeu_epi16(out + r * out_stride + c, mask, h);
    }
  }
}

// Where row tile r0's A tiles come from: the input in place or its padded copy; stride in bytes.
struct ATile {
  const char* base;
  int stride;
};

ATile a_tile(const AmxProblem& pr, int64_t r0) {
  const PackedLinearParams& p = *pr.p;
  if (r0 + kTileM <= pr.padded_from) {
    return {reinterpret_cast<const char*>(static_cast<const BFloat16*>(p.input) + r0 * p.input_stride),
            static_cast<int>(p.input_stride * sizeof(BFloat16))};
  }
  return {reinterpret_cast<const char*>(pr.padded + (r0 - pr.padded_from) * pr.padded_stride),
          static_cast<int>(pr.padded_stride * sizeof(BFloat16))};
}

// B tile step s of the panel (16 pairs x 48 features), the zero-padded copy for a last partial step.
inline const char* b_step(const char* panel, int64_t s, int64_t full_steps, const BFloat16* tail_b) {
  return s < full_steps ? panel + s * kTileStepBytes : reinterpret_cast<const char*>(tail_b);
}

constexpr int kSumsStride = kPanelWidth * sizeof(float);
constexpr int64_t kColBytes = kTileN * kPairBytes;  // a column tile's bytes within a panel row

// One row tile (16 rows) x the panel: sums tmm0-2 [16][48], A tmm3, B tmm4-6. Each B tile
// serves one row tile. Tried against this on the default model's layer GEMMs (alternated
// builds, 2026-12-05), none faster: sharing B tiles between row tiles (2 x 2 sums over the
// panel's first two column tiles, then 2 x 1 or 4 x 1 over its third: 0.9-0.97x at 32-2048
// rows), and software pipelining (the next K step's A into a second tile and each B tile's
// next load right after the product that reads it: 1.00-1.05x, within the noise).
// At decode's sizes the weights' read rate drops from ~23 GB/s at 1-16 rows to ~19 at 17-32
// (a second row tile; 2026-12-06, cold weights). Tried there, none faster: both row tiles in
// one pass over K sharing each B tile (six sums, level), software prefetch of the panel a few
// K steps ahead (0.95x), and of the next panel into L2 under the row tiles (0.75-0.85x).
void row_tile(ATile a, const char* panel, int64_t k_steps, int64_t full_steps, const BFloat16* tail_b,
              float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t s = 0; s < k_steps; ++s) {
    const char* b = b_step(panel, s, full_steps, tail_b);
    _tile_loadd(3, a.base + s * kTileK * sizeof(BFloat16), a.stride);
    _tile_loadd(4, b, kPanelRowBytes);
    _tile_loadd(5, b + kColBytes, kPanelRowBytes);
    _tile_loadd(6, b + 2 * kColBytes, kPanelRowBytes);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  _tile_stored(0, sums, kSumsStride);
  _tile_stored(1, sums + kTileN, kSumsStride);
  _tile_stored(2, sums + 2 * kTileN, kSumsStride);
}

// Task t of one product: panel t % panels over row block t / panels, a row tile at a time.
// `tail_b`: 16 panel rows of scratch for the panel's last B tile when its pair count is not a
// multiple of 16.
void run_task(const AmxProblem& pr, int64_t t, BFloat16* tail_b) {
  const PackedLinearParams& p = *pr.p;
  const int64_t panel = t % pr.panels, m0 = (t / pr.panels) * pr.row_block;
  const int64_t m1 = std::min(p.M, m0 + pr.row_block);
  const int64_t n0 = panel * kPanelWidth, n = std::min(kPanelWidth, p.N - n0);
  const char* panel_base = static_cast<const char*>(p.weight) + panel * pr.pairs * kPanelRowBytes;
  const int64_t full_steps = pr.pairs / kTilePairs;
  const int64_t tail_pairs = pr.pairs - full_steps * kTilePairs;
  if (tail_pairs > 0) {
    // The panel ends inside this B tile: its rows, then zero rows (reading on would leave the tensor).
    std::memcpy(tail_b, panel_base + full_steps * kTileStepBytes, tail_pairs * kPanelRowBytes);
    std::memset(reinterpret_cast<char*>(tail_b) + tail_pairs * kPanelRowBytes, 0,
                (kTilePairs - tail_pairs) * kPanelRowBytes);
  }
  alignas(64) float bias[kPanelWidth];
  const BFloat16* bias_src = static_cast<const BFloat16*>(p.bias);
  for (int64_t c = 0; c < kPanelWidth; ++c) bias[c] = bias_src && c < n ? static_cast<float>(bias_src[n0 + c]) : 0.f;
  alignas(64) float sums[kTileM * kPanelWidth];
  BFloat16* out = static_cast<BFloat16*>(p.out);
  for (int64_t r0 = m0; r0 < m1; r0 += kTileM) {
    row_tile(a_tile(pr, r0), panel_base, pr.k_steps, full_steps, tail_b, sums);
    store_rows(sums, bias, std::min(kTileM, m1 - r0), n, out + r0 * p.out_stride + n0, p.out_stride);
  }
}

// Estimated cost of a task: its row tiles' tile products plus reading its panel once
// (as much as ~2 row tiles' products: a few-row task is bound by the read).
int64_t task_cost(const AmxProblem& pr, int64_t t) {
  const int64_t m0 = (t / pr.panels) * pr.row_block;
  const int64_t row_tiles = (std::min(pr.p->M, m0 + pr.row_block) - m0 + kTileM - 1) / kTileM;
  return pr.k_steps * (row_tiles + 2);
}

}  // namespace

void packed_linear_amx(const PackedLinearBatch& batch) {
  std::vector<AmxProblem> problems;
  std::vector<std::vector<BFloat16>> padded(batch.count);
  int64_t num_tasks = 0;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  for (int64_t i = 0; i < batch.count; ++i) {
    const PackedLinearParams& p = batch.problems[i];
    TORCH_CHECK(p.dtype == c10::ScalarType::BFloat16, "packed_linear (AMX): expected bfloat16, got ", p.dtype);
    if (p.M == 0 || p.N == 0) continue;
    AmxProblem pr{&p, (p.K + 1) / 2, 0, 0, nullptr, 0, 0, 0, 0, num_tasks};
    pr.k_steps = (pr.pairs + kTilePairs - 1) / kTilePairs;
    pad_input(pr, padded[i]);
    pr.panels = (p.N + kPanelWidth - 1) / kPanelWidth;
    // Row blocks of whole tiles, equal in size, more of them when the panels are too few to
    // give every thread several tasks.
    const int64_t row_tiles = (p.M + kTileM - 1) / kTileM;
    int64_t blocks = (p.M + kAmxRowBlock - 1) / kAmxRowBlock;
    while (pr.panels * blocks < 4 * threads && row_tiles / (blocks + 1) >= 2) ++blocks;
    pr.row_block = (row_tiles + blocks - 1) / blocks * kTileM;
    pr.row_blocks = (p.M + pr.row_block - 1) / pr.row_block;
    problems.push_back(pr);
    num_tasks += pr.panels * pr.row_blocks;
  }
  if (problems.empty()) return;
  // The tasks in `threads` contiguous runs of about equal cost (one parallel region, no
  // barrier between the batch's products).
  std::vector<int64_t> cost_before(num_tasks + 1, 0);
  for (const AmxProblem& pr : problems) {
    for (int64_t t = 0; t < pr.panels * pr.row_blocks; ++t) {
      cost_before[pr.first_task + t + 1] = cost_before[pr.first_task + t] + task_cost(pr, t);
    }
  }
  const std::vector<int64_t> bounds = equal_cost_runs(cost_before, threads);
  at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
    if (bounds[w0] == bounds[w1]) return;
    alignas(64) BFloat16 tail_b[kTilePairs * kPanelWidth * 2];
    configure_amx_tiles();
    size_t i = 0;
    for (int64_t t = bounds[w0]; t < bounds[w1]; ++t) {
      while (i + 1 < problems.size() && problems[i + 1].first_task <= t) ++i;
      run_task(problems[i], t - problems[i].first_task, tail_b);
    }
    _tile_release();
  });
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
