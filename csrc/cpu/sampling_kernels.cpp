// One token per row from float32 logits (sampling_kernels.h), the draw of
// pagedkv.model.sampler (after its top-k / top-p / min-p filters, if any): per row a max
// pass, then a pass that sums w_j = exp((l_j - max) / T) in blocks of kBlock entries,
// keeping each block's sum; then x = u * total, and the running sum goes block by block up
// to the block where it reaches x, whose weights are taken again one at a time up to the
// token. Two passes over the row where the torch sequence (divide by T, softmax, cumsum,
// searchsorted) took five with a single-threaded cumsum: on 48 x 49152 logits 1.1 ms
// against 5-9 ms, 1.5x a greedy step (bench/bench_sampler.py). The sums differ from
// torch's in rounding only, so a u within a few ulps of a boundary between two tokens may
// pick the neighbour; the distribution is the same (tests/test_sampler.py).
#include "cpu/sampling_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pagedkv::cpu::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();
// Entries per block sum: the final scan recomputes at most one block.
constexpr int64_t kBlock = 256;

// The row's max; NaN if any entry is NaN (as torch's max propagates it).
float row_max(const float* row, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const Vec v = Vec::loadu(row + j);
    m = at::vec::maximum(m, v);  // propagates NaN
  }
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; j < n; ++j) out = std::isnan(row[j]) || std::isnan(out) ? std::numeric_limits<float>::quiet_NaN()
                                                                   : std::max(out, row[j]);
  return out;
}

// Greedy: the first index of the max (of the first NaN where there is one), as max(-1).indices.
int64_t first_max(const float* row, int64_t n) {
  const float m = row_max(row, n);
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(m) ? std::isnan(row[j]) : row[j] == m) return j;
  }
  return n - 1;
}

int64_t draw(const float* row, int64_t n, float temperature, float u, std::vector<float>& sums) {
  const float m = row_max(row, n);
  const float inv_t = 1.f / temperature;
  const Vec mv(m), iv(inv_t);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.resize(blocks);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
    Vec acc(0.f);
    int64_t j = j0;
    for (; j + kW <= j1; j += kW) acc = acc + ((Vec::loadu(row + j) - mv) * iv).exp_u20();
    if (j < j1) {
      // The tail's missing lanes load as 0 and are masked out of the sum.
      const Vec e = ((Vec::loadu(row + j, j1 - j) - mv) * iv).exp_u20();
      acc = acc + Vec::set(Vec(0.f), e, j1 - j);
    }
    sums[b] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
    total += sums[b];
  }
  // x in (0, total]: a token of weight 0 (a -inf logit) is never the first to reach it. NaN
  // logits (or all -inf) make the total NaN: the last token, as torch's searchsorted gives.
  if (!(total > 0.f) || std::isnan(total)) return n - 1;
  const float x = std::max(u * total, std::numeric_limits<float>::min());
  float before = 0.f;
  int64_t b = 0;
  while (b + 1 < blocks && before + sums[b] < x) before += sums[b++];
  const int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
  int64_t last = -1;  // the block's last token of weight > 0, should rounding leave x out of reach
  for (int64_t j = j0; j < j1; ++j) {
    const float w = std::exp((row[j] - m) * inv_t);
    if (w > 0.f) last = j;
    before += w;
    if (before >= x && w > 0.f) return j;
  }
  return last >= 0 ? last : n - 1;
}

}  // namespace

void sample_from_logits(const SampleParams& p) {
  // Rows in parallel: each is two passes over vocab floats (~200 KB for 49k), enough to wake a thread for.
  at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = p.logits + r * p.logits_stride;
      const float t = p.temperatures[r];
      p.out[r] = t == 0.f ? first_max(row, p.vocab) : draw(row, p.vocab, t, p.uniforms[r], sums);
    }
  });
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
