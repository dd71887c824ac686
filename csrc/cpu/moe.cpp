// Fused mixture-of-experts (SwiGLU experts) on the CPU: grouped GEMMs, no per-token work in Python.
//
//   1. counting sort of the T*K (token, slot) pairs by expert: expert e owns rows
//      [offsets[e], offsets[e+1]) of one gathered buffer;
//   2. gather the hidden rows of those pairs into that buffer, in sorted order;
//   3. per expert with rows: [rows, H] x w13[e]^T -> [rows, 2I] into its rows of one buffer,
//      then silu(gate) * up over the whole buffer (ATen's vectorized kernels);
//   4. per expert: [rows, I] x w2[e]^T -> [rows, H], into its rows;
//   5. (steps 3-4 run pagedkv-packed experts as one grouped product over all threads; other
//      experts side by side, one thread each, when every expert has few rows, as in decode,
//      else one after the other with all threads in each GEMM);
//   6. per token: out[t] = sum_k weight[t, k] * y[position of (t, k)], in fp32.
// The GEMMs go through at::mm_out (oneDNN / BLAS, which parallelize inside), or
// on weights prepacked per expert when the caller passes them (w13_packed /
// w2_packed), for pagedkv's own GEMM (pack_linear_weight, csrc/cpu/gemm.cpp) or for
// oneDNN's (mkldnn._reorder_linear_weight): an expert's few rows in decode are the
// small-M products where prepacked weights gain most (oneDNN's fp32 1.3-2x over MKL's
// sgemm on a Zen 4, one-row GEMVs included; pagedkv's 1.1-1.6x oneDNN's on an AVX2 Zen 3,
// bench/results/moe_avx2_cpu.md).
// Then the plain w13 / w2 give only the shapes and are never read, so a caller may
// drop their storage, e.g. pass zero-stride views. The
// combine gathers instead of scattering, so each token is written once, by one
// thread, in a fixed order: no atomics and the result does not depend on threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace pagedkv {
namespace {

constexpr const char* kOp = "fused_moe";

struct MoeDims {
  int64_t num_tokens;    // T
  int64_t hidden;        // H
  int64_t num_experts;   // E
  int64_t intermediate;  // I (this rank's slice)
  int64_t top_k;         // K
};

bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

MoeDims check_moe_inputs(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(hidden.dim() == 2, kOp, ": hidden must be 2-D [num_tokens, hidden_size], got shape ", hidden.sizes());
  TORCH_CHECK(is_float_dtype(hidden.scalar_type()), kOp, ": hidden must be float32, bfloat16 or float16, got ",
              hidden.scalar_type());
  TORCH_CHECK(w13.dim() == 3, kOp, ": w13 must be 3-D [num_experts, 2 * intermediate, hidden_size], got shape ",
              w13.sizes());
  TORCH_CHECK(w2.dim() == 3, kOp, ": w2 must be 3-D [num_experts, hidden_size, intermediate], got shape ",
              w2.sizes());
  const int64_t top_k = topk_ids.dim() == 2 ? topk_ids.size(1) : 0;
  const MoeDims d{hidden.size(0), hidden.size(1), w13.size(0), w13.size(1) / 2, top_k};
  TORCH_CHECK(d.num_experts > 0, kOp, ": w13 holds no experts (shape ", w13.sizes(), ")");
  TORCH_CHECK(w13.size(1) % 2 == 0 && w13.size(1) > 0, kOp,
              ": w13's dim 1 must be 2 * intermediate (gate rows then up rows), got ", w13.size(1));
  TORCH_CHECK(w13.size(2) == d.hidden, kOp, ": w13 must be [num_experts, 2 * intermediate, ", d.hidden,
              "] to match hidden's size ", d.hidden, ", got ", w13.sizes());
  TORCH_CHECK(w2.size(0) == d.num_experts && w2.size(1) == d.hidden && w2.size(2) == d.intermediate, kOp,
              ": w2 must be [", d.num_experts, ", ", d.hidden, ", ", d.intermediate, "] to match w13 ", w13.sizes(),
              ", got ", w2.sizes());
  TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() && w2.scalar_type() == hidden.scalar_type(), kOp,
              ": w13 and w2 must have hidden's dtype ", hidden.scalar_type(), ", got ", w13.scalar_type(), " and ",
              w2.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == d.num_tokens && topk_ids.size(1) > 0, kOp,
              ": topk_ids must be [num_tokens=", d.num_tokens, ", top_k >= 1], got shape ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, kOp,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), kOp, ": topk_weights must have topk_ids' shape ",
              topk_ids.sizes(), ", got ", topk_weights.sizes());
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat || topk_weights.scalar_type() == hidden.scalar_type(), kOp,
              ": topk_weights must be float32 or hidden's dtype ", hidden.scalar_type(), ", got ",
              topk_weights.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"hidden", hidden}, {"w13", w13},
                                {"w2", w2}, {"topk_weights", topk_weights}, {"topk_ids", topk_ids}}) {
    TORCH_CHECK(t.is_cpu(), kOp, ": the CPU kernel needs CPU tensors, but ", name, " is on ", t.device());
  }
  return d;
}

// Rows of the gathered buffer, grouped by expert. order[r] is the flat pair index
// t * K + k that row r serves; position[p] the row that pair p landed in.
struct ExpertGroups {
  std::vector<int64_t> offsets;   // [E + 1]
  at::Tensor order;               // int64 [T * K]
  std::vector<int64_t> position;  // [T * K]
};

// Counting sort (stable: rows of one expert keep token order), which also checks every id.
template <typename id_t>
ExpertGroups group_by_expert(const at::Tensor& topk_ids, int64_t num_experts) {
  const at::Tensor ids_c = topk_ids.contiguous();
  const id_t* ids = ids_c.const_data_ptr<id_t>();
  const int64_t n = ids_c.numel();
  ExpertGroups g;
  g.offsets.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = ids[p];
    TORCH_CHECK(e >= 0 && e < num_experts, kOp, ": topk_ids must be in [0, ", num_experts, "), got ", e,
                " at [", p / ids_c.size(1), ", ", p % ids_c.size(1), "]");
    ++g.offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.order = at::empty({n}, topk_ids.options().dtype(at::kLong));
  int64_t* order = g.order.data_ptr<int64_t>();
  g.position.resize(n);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t row = next[ids[p]]++;
    order[row] = p;
    g.position[p] = row;
  }
  return g;
}

// Whether an expert's packed weight is pagedkv's (pack_linear_weight: 3-D fp32, 4-D bf16
// panels) rather than oneDNN's (the weight's own 2-D shape); check_packed checked which.
bool is_pagedkv_packed(const at::Tensor& packed) { return packed.dim() != 2; }

// Each entry: a CPU tensor of hidden's dtype, either pagedkv's packing of an [out, in]
// weight or oneDNN's (shape [out, in]).
void check_packed(const char* name, const std::optional<at::TensorList>& packed, const at::Tensor& hidden,
                  int64_t num_experts, int64_t out, int64_t in) {
  if (!packed.has_value()) return;
  TORCH_CHECK(static_cast<int64_t>(packed->size()) == num_experts, kOp, ": ", name, " must hold one packed weight "
              "per expert (", num_experts, "), got ", packed->size());
  const c10::ScalarType dtype = hidden.scalar_type();
  const bool packable = dtype == at::kFloat || dtype == at::kBFloat16;  // pack_linear_weight's dtypes
  const std::vector<int64_t> pagedkv_shape =
      packable ? packed_linear_weight_shape(out, in, dtype) : std::vector<int64_t>{};
  for (size_t e = 0; e < packed->size(); ++e) {
    const at::Tensor& t = (*packed)[e];
    TORCH_CHECK(t.defined() && t.is_cpu() && t.scalar_type() == dtype, kOp, ": every ", name, " entry must be a CPU ",
                dtype, " tensor from pack_linear_weight or torch.ops.mkldnn._reorder_linear_weight");
    const bool fits = t.sizes() == c10::IntArrayRef({out, in}) ||
                      (!pagedkv_shape.empty() && t.sizes() == c10::IntArrayRef(pagedkv_shape) && t.is_contiguous());
    TORCH_CHECK(fits, kOp, ": ", name, "[", e, "] must be a [", out, ", ", in, "] expert weight packed by "
                "pack_linear_weight (shape ", c10::IntArrayRef(pagedkv_shape), ", contiguous) or by "
                "torch.ops.mkldnn._reorder_linear_weight (shape [", out, ", ", in, "]), got shape ", t.sizes());
  }
}

// x [M, in] times a weight packed by torch.ops.mkldnn._reorder_linear_weight -> [M, out].
// Called through the dispatcher, boxed: the op is torch's, its C++ signature is not API.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Experts with at most this many rows each run side by side, one per thread, each GEMM
// single-threaded: a decode step gives every expert a few rows, and one small GEMM
// split over all threads spends more on its barriers than on its FLOPs. Above it the
// experts run one after the other, each GEMM on every thread (prefill chunks). Experts
// packed for pagedkv's GEMM skip both: they run as one grouped product.
constexpr int64_t kExpertsInParallelMaxRows = 64;

// For each expert e with rows: out rows [offsets[e], offsets[e + 1]) = in's same rows x w[e]^T.
// pagedkv-packed experts go in one grouped call (packed_linear_grouped_cpu: every thread streams
// the panels of every expert, no barrier between experts, so one or two busy experts keep every
// thread reading); the others (plain weights, oneDNN's packing) one GEMM per expert, experts with
// few rows side by side.
void grouped_mm(const at::Tensor& in, const at::Tensor& w, const std::optional<at::TensorList>& packed,
                const std::vector<int64_t>& offsets, at::Tensor& out) {
  std::vector<int64_t> grouped, experts;
  int64_t max_rows = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;  // most experts get no rows in decode
    if (packed.has_value() && is_pagedkv_packed((*packed)[e])) {
      grouped.push_back(static_cast<int64_t>(e));
      continue;
    }
    experts.push_back(static_cast<int64_t>(e));
    max_rows = std::max(max_rows, rows);
  }
  if (!grouped.empty()) packed_linear_grouped_cpu(out, in, *packed, grouped, offsets);
  auto run = [&](int64_t e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    const at::Tensor in_rows = in.narrow(0, begin, rows);
    at::Tensor out_rows = out.narrow(0, begin, rows);
    if (packed.has_value()) {
      out_rows.copy_(onednn_linear(in_rows, (*packed)[e]));  // oneDNN returns its own tensor
    } else {
      at::mm_out(out_rows, in_rows, w[e].t());
    }
  };
  const int64_t n = static_cast<int64_t>(experts.size());
  const int64_t threads = at::get_num_threads();
  if (n < 2 || max_rows > kExpertsInParallelMaxRows || threads < 2 || at::in_parallel_region()) {
    for (int64_t e : experts) run(e);
    return;
  }
  // One bin of experts per thread, filled largest first into the emptiest bin, so the threads
  // finish close together. The caller's thread-local state (inference mode, grad mode) goes with
  // each task: at::parallel_for does not carry it; it does rethrow the tasks' errors.
  std::sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) {
    return offsets[a + 1] - offsets[a] > offsets[b + 1] - offsets[b];
  });
  const int64_t num_bins = std::min(threads, n);
  std::vector<std::vector<int64_t>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  for (int64_t e : experts) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(e);
    load[b] += offsets[e + 1] - offsets[e];
  }
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, num_bins, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller_state);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t e : bins[b]) run(e);
    }
  });
}

// out[t] = sum_k weights[t, k] * y[position[t * K + k]], accumulated in fp32 in pair order.
template <typename scalar_t, typename weight_t>
void combine(const at::Tensor& y, const at::Tensor& topk_weights, const std::vector<int64_t>& position,
             const MoeDims& d, at::Tensor& out) {
  const scalar_t* ys = y.const_data_ptr<scalar_t>();
  const at::Tensor w_c = topk_weights.contiguous();
  const weight_t* ws = w_c.const_data_ptr<weight_t>();
  scalar_t* os = out.data_ptr<scalar_t>();
  const int64_t H = d.hidden, K = d.top_k;
  // Grain: enough tokens that a task reads ~64K values (amortizes the task start).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, H * K));
  at::parallel_for(0, d.num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float w = static_cast<float>(ws[t * K + k]);
        const scalar_t* row = ys + position[t * K + k] * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(row[h]);
      }
      scalar_t* o = os + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = static_cast<scalar_t>(acc[h]);
    }
  });
}

}  // namespace

at::Tensor fused_moe_cpu(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const std::optional<at::TensorList>& w13_packed,
                         const std::optional<at::TensorList>& w2_packed) {
  const MoeDims d = check_moe_inputs(hidden, w13, w2, topk_weights, topk_ids);
  check_packed("w13_packed", w13_packed, hidden, d.num_experts, 2 * d.intermediate, d.hidden);
  check_packed("w2_packed", w2_packed, hidden, d.num_experts, d.hidden, d.intermediate);
  at::Tensor out = at::empty({d.num_tokens, d.hidden}, hidden.options());
  if (d.num_tokens == 0 || d.hidden == 0) return out;
  const ExpertGroups g = topk_ids.scalar_type() == at::kInt ? group_by_expert<int32_t>(topk_ids, d.num_experts)
                                                            : group_by_expert<int64_t>(topk_ids, d.num_experts);
  const int64_t n = d.num_tokens * d.top_k;
  // Row r of the gathered buffer is token order[r] / K.
  const at::Tensor x = hidden.index_select(0, g.order.div(d.top_k, "floor"));  // [n, H]
  // With packed weights the plain ones are not read (they may be zero-stride placeholders).
  const at::Tensor w13_c = w13_packed.has_value() ? w13 : w13.contiguous();
  const at::Tensor w2_c = w2_packed.has_value() ? w2 : w2.contiguous();

  // Every expert's gate and up products, then silu(gate) * up over all rows at once with
  // ATen's kernels; in 16-bit dtypes both steps round to the dtype, as HF's act_fn(gate) * up does.
  const int64_t inter = d.intermediate;
  at::Tensor gate_up = at::empty({n, 2 * inter}, hidden.options());
  grouped_mm(x, w13_c, w13_packed, g.offsets, gate_up);
  at::Tensor act = at::silu(gate_up.narrow(1, 0, inter));
  act.mul_(gate_up.narrow(1, inter, inter));

  at::Tensor y = at::empty({n, d.hidden}, hidden.options());
  grouped_mm(act, w2_c, w2_packed, g.offsets, y);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "fused_moe_combine", [&] {
    if (topk_weights.scalar_type() == at::kFloat) {
      combine<scalar_t, float>(y, topk_weights, g.position, d, out);
    } else {
      combine<scalar_t, scalar_t>(y, topk_weights, g.position, d, out);
    }
  });
  return out;
}

}  // namespace pagedkv
