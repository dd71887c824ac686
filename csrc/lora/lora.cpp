// `lora_linear_add`: the LoRA adapters of a multi-LoRA batch added to a base linear's
// output, punica's SGMV (shrink, then expand) segmented by adapter slot. Written with ATen
// calls only (mm / addmm_ / index_select / index_add_ / narrow), so one kernel serves the
// CPU and CUDA (registered CompositeExplicitAutograd); the GEMMs are torch's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <utility>

#include "common/validation.h"
#include "ops.h"

namespace pagedkv {
namespace {

constexpr const char* kOp = "lora_linear_add";

c10::IntArrayRef shape_of(const at::Tensor& t) { return t.defined() ? t.sizes() : c10::IntArrayRef{}; }

using Named = std::pair<const at::Tensor*, const char*>;

bool is_lora_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// The shape, dtype and device checks (never skipped). Returns R, the adapters' max rank.
int64_t check_lora_inputs(const at::Tensor& out, const at::Tensor& input, const at::Tensor& lora_a,
                          const at::Tensor& lora_b, const at::Tensor& token_rows, const at::Tensor& slot_starts,
                          at::IntArrayRef slice_offsets) {
  TORCH_CHECK(out.defined() && out.dim() == 2, kOp, ": out must be 2-D [num_tokens, out_features], got shape ",
              shape_of(out));
  TORCH_CHECK(input.defined() && input.dim() == 2, kOp, ": input must be 2-D [num_tokens, in_features], got shape ",
              shape_of(input));
  const int64_t T = out.size(0), N = out.size(1), K = input.size(1);
  TORCH_CHECK(input.size(0) == T, kOp, ": input must have out's ", T, " rows (num_tokens), got shape ",
              input.sizes());
  TORCH_CHECK(lora_a.defined() && lora_a.dim() == 3, kOp,
              ": lora_a must be 3-D [num_slots, n_slices * max_rank, in_features], got shape ", shape_of(lora_a));
  TORCH_CHECK(lora_b.defined() && lora_b.dim() == 3, kOp,
              ": lora_b must be 3-D [num_slots, out_features, max_rank], got shape ", shape_of(lora_b));
  const int64_t S = lora_a.size(0), R = lora_b.size(2);
  TORCH_CHECK(lora_a.size(2) == K, kOp, ": lora_a must be [num_slots, n_slices * max_rank, in_features = ", K,
              "] (input's columns), got shape ", lora_a.sizes());
  TORCH_CHECK(lora_b.size(0) == S && lora_b.size(1) == N, kOp, ": lora_b must be [num_slots = ", S,
              " (lora_a's), out_features = ", N, " (out's columns), max_rank], got shape ", lora_b.sizes());

  const int64_t n_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(n_slices >= 1, kOp, ": slice_offsets must hold n_slices + 1 >= 2 column offsets, got ", slice_offsets);
  TORCH_CHECK(slice_offsets.front() == 0 && slice_offsets.back() == N, kOp,
              ": slice_offsets must start at 0 and end at out_features = ", N, ", got ", slice_offsets);
  for (int64_t j = 0; j < n_slices; ++j) {
    TORCH_CHECK(slice_offsets[j] < slice_offsets[j + 1], kOp, ": slice_offsets must be strictly increasing, got ",
                slice_offsets);
  }
  TORCH_CHECK(lora_a.size(1) == n_slices * R, kOp, ": lora_a.size(1) must be n_slices * max_rank = ", n_slices,
              " * ", R, " (slice_offsets and lora_b.size(2)) = ", n_slices * R, ", got shape ", lora_a.sizes());

  TORCH_CHECK(is_lora_dtype(out.scalar_type()), kOp, ": out must be float32, bfloat16 or float16, got ",
              out.scalar_type());
  const Named floats[] = {{&input, "input"}, {&lora_a, "lora_a"}, {&lora_b, "lora_b"}};
  for (const auto& [t, name] : floats) {
    TORCH_CHECK(t->scalar_type() == out.scalar_type(), kOp, ": ", name, " must have out's dtype ", out.scalar_type(),
                ", got ", t->scalar_type());
  }

  TORCH_CHECK(token_rows.defined() && token_rows.dim() == 1, kOp,
              ": token_rows must be 1-D [num_lora_rows], got shape ", shape_of(token_rows));
  TORCH_CHECK(token_rows.scalar_type() == at::kLong, kOp, ": token_rows must be int64, got ",
              token_rows.scalar_type());
  TORCH_CHECK(slot_starts.defined() && slot_starts.dim() == 1 && slot_starts.size(0) == S + 1, kOp,
              ": slot_starts must be 1-D [num_slots + 1 = ", S + 1, "], got shape ", shape_of(slot_starts));
  TORCH_CHECK(slot_starts.scalar_type() == at::kLong, kOp, ": slot_starts must be int64, got ",
              slot_starts.scalar_type());

  const Named others[] = {{&input, "input"},
                          {&lora_a, "lora_a"},
                          {&lora_b, "lora_b"},
                          {&token_rows, "token_rows"},
                          {&slot_starts, "slot_starts"}};
  for (const auto& [t, name] : others) {
    TORCH_CHECK(t->device() == out.device(), kOp, ": ", name, " is on ", t->device(), " but out is on ",
                out.device());
  }
  return R;
}

// Value checks (behind index_checks_enabled): slot_starts from 0, nondecreasing, ending at M;
// every row in [0, T). starts/rows: the host copies.
void check_lora_index_values(const int64_t* starts, int64_t S, const int64_t* rows, int64_t M, int64_t T) {
  TORCH_CHECK(starts[0] == 0, kOp, ": slot_starts[0] must be 0, got ", starts[0]);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(starts[s] <= starts[s + 1], kOp, ": slot_starts must be nondecreasing, got slot_starts[", s,
                "] = ", starts[s], " > slot_starts[", s + 1, "] = ", starts[s + 1]);
  }
  TORCH_CHECK(starts[S] == M, kOp, ": slot_starts[", S, "] (the last) must be the ", M,
              " token_rows, got ", starts[S]);
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < T, kOp, ": token_rows[", i, "] = ", rows[i], " is outside the ", T,
                " rows of input and out");
  }
}

// rows[0..n) are first, first + 1, ..., first + n - 1: one slice of the batch (narrow, no gather).
bool consecutive_rows(const int64_t* rows, int64_t n) {
  if (rows[n - 1] - rows[0] != n - 1) return false;
  for (int64_t i = 1; i < n; ++i) {
    if (rows[i] <= rows[i - 1]) return false;
  }
  return true;
}

// out[rows[i], :] += delta[i, :] on the CPU: torch's index_add_ scatters element by element on one
// thread (a millisecond per projection in a decode step); this adds whole rows, the columns split over
// the threads, so a row listed twice is still added twice without a race.
void add_rows_cpu(at::Tensor& out, const int64_t* rows, int64_t n, const at::Tensor& delta) {
  const int64_t N = out.size(1), so = out.stride(0), sc = out.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_linear_add", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* d = delta.const_data_ptr<scalar_t>();  // contiguous [n, N]
    at::parallel_for(0, N, 512, [&](int64_t c0, int64_t c1) {
      for (int64_t i = 0; i < n; ++i) {
        scalar_t* orow = o + rows[i] * so;
        const scalar_t* drow = d + i * N;
        if (sc == 1) {
          for (int64_t c = c0; c < c1; ++c) {
            orow[c] = static_cast<scalar_t>(static_cast<float>(orow[c]) + static_cast<float>(drow[c]));
          }
        } else {
          for (int64_t c = c0; c < c1; ++c) {
            orow[c * sc] = static_cast<scalar_t>(static_cast<float>(orow[c * sc]) + static_cast<float>(drow[c]));
          }
        }
      }
    });
  });
}

}  // namespace

void lora_linear_add(at::Tensor& out, const at::Tensor& input, const at::Tensor& lora_a, const at::Tensor& lora_b,
                     const at::Tensor& token_rows, const at::Tensor& slot_starts, at::IntArrayRef slice_offsets) {
  const int64_t R = check_lora_inputs(out, input, lora_a, lora_b, token_rows, slot_starts, slice_offsets);
  const int64_t T = out.size(0), S = lora_a.size(0), M = token_rows.size(0);
  const int64_t n_slices = static_cast<int64_t>(slice_offsets.size()) - 1;

  // The segment bounds and the fast-path test need the index values on the host: read in place on the
  // CPU; on CUDA one copy of both (slot_starts, then token_rows) per call, a device->host sync.
  at::Tensor host_starts, host_rows;
  if (slot_starts.is_cpu()) {
    host_starts = slot_starts.contiguous();
    host_rows = token_rows.contiguous();
  } else {
    const at::Tensor host = at::cat({slot_starts, token_rows}).to(at::kCPU);
    host_starts = host.narrow(0, 0, S + 1);
    host_rows = host.narrow(0, S + 1, M);
  }
  const int64_t* starts = host_starts.const_data_ptr<int64_t>();
  const int64_t* rows = host_rows.const_data_ptr<int64_t>();
  if (index_checks_enabled()) check_lora_index_values(starts, S, rows, M, T);

  for (int64_t s = 0; s < S; ++s) {
    const int64_t begin = starts[s], n = starts[s + 1] - begin;
    if (n == 0) continue;
    // With the value checks off, a bad segment stops in narrow with an error, and so does a bad row
    // (narrow, or index_select / index_add_, whose CPU kernels check; CUDA's raise a device-side assert).
    const at::Tensor a = lora_a.select(0, s), b = lora_b.select(0, s);
    if (n > 0 && begin >= 0 && begin + n <= M && consecutive_rows(rows + begin, n)) {
      // One decode batch on one adapter: rows first .. first + n - 1 of input and out, as views.
      const at::Tensor xa = at::mm(input.narrow(0, rows[begin], n), a.t());
      at::Tensor out_rows = out.narrow(0, rows[begin], n);
      for (int64_t j = 0; j < n_slices; ++j) {
        const int64_t off = slice_offsets[j], width = slice_offsets[j + 1] - off;
        out_rows.narrow(1, off, width).addmm_(xa.narrow(1, j * R, R), b.narrow(0, off, width).t());
      }
    } else {
      const at::Tensor index = token_rows.narrow(0, begin, n);
      const at::Tensor xa = at::mm(input.index_select(0, index), a.t());
      // Each slice's product into its columns of one [n, N] delta, then one scatter-add into out.
      at::Tensor delta = at::empty({n, out.size(1)}, out.options());
      for (int64_t j = 0; j < n_slices; ++j) {
        const int64_t off = slice_offsets[j], width = slice_offsets[j + 1] - off;
        at::Tensor cols = delta.narrow(1, off, width);
        at::mm_out(cols, xa.narrow(1, j * R, R), b.narrow(0, off, width).t());
      }
      if (out.is_cpu()) {
        // The value checks may be off: a bad row stops here with an error, never a stray write.
        for (int64_t i = 0; i < n; ++i) {
          TORCH_CHECK(rows[begin + i] >= 0 && rows[begin + i] < T, kOp, ": token_rows[", begin + i, "] = ",
                      rows[begin + i], " is outside the ", T, " rows of input and out");
        }
        add_rows_cpu(out, rows + begin, n, delta);
      } else {
        out.index_add_(0, index, delta);
      }
    }
  }
}

}  // namespace pagedkv
