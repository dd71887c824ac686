// The CPU linear layer: out [M, N] = input [M, K] @ W^T (+ bias) on a weight packed
// once into column panels (pack_linear_weight, csrc/cpu/gemm.cpp). gemm_kernels.cpp is
// compiled once per instruction set, like attention_kernels.cpp; gemm.cpp validates the
// tensors, fills PackedLinearParams and calls the variant picked by cpu_capability.h.
//
// Packed layout: the N output features in panels of kPanelWidth (the last one padded
// with zero columns); within a panel the K inputs in order, each a row of kPanelWidth
// weights, one per output feature. bf16 weights go in pairs of inputs (K padded to
// even with a zero), so a panel row holds the pair (W[n, 2j], W[n, 2j + 1]) of each
// feature, as vdpbf16ps takes its operand:
//   fp32: [ceil(N / 48), K,            48]     packed[p][k][c]    = W[48 p + c][k]
//   bf16: [ceil(N / 48), ceil(K / 2), 48, 2]  packed[p][j][c][e] = W[48 p + c][2 j + e]
// A task streams one panel from memory start to end, and every weight it loads serves
// up to 8 input rows.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace pagedkv::cpu {

// Output features per panel: three AVX-512 (six AVX2) fp32 vectors, so 8 rows x 3
// vectors of accumulators fit in the 32 AVX-512 registers with the weights beside them.
constexpr int64_t kPanelWidth = 48;

struct PackedLinearParams {
  c10::ScalarType dtype;  // float or bfloat16: input, weight, bias and out alike
  const void* input;      // [M, K], rows dense
  int64_t input_stride;   // elements between rows
  const void* weight;     // packed, see above
  const void* bias;       // [N] or nullptr
  void* out;              // [M, N], rows dense
  int64_t out_stride;
  int64_t M, N, K;
};

// Products run together in one parallel region, all of one dtype: a mixture-of-experts
// layer's experts, each on its own rows of a gathered buffer. Their tasks (panels x row
// blocks) are dealt to the threads in contiguous runs of equal estimated cost, so no thread
// waits at a barrier between products and few-row products keep every thread streaming.
struct PackedLinearBatch {
  const PackedLinearParams* problems;
  int64_t count;
};

// A batch's tasks cut into `parts` contiguous runs of about equal cost, given the running
// sums cost_before[t] (the cost of tasks [0, t), num_tasks + 1 entries): bounds[i] is run i's
// first task (parts + 1 entries, the last num_tasks). Defined once, in the baseline gemm.cpp,
// for every variant (an inline function here would be compiled with each variant's flags
// and the linker could keep any one copy).
std::vector<int64_t> equal_cost_runs(const std::vector<int64_t>& cost_before, int64_t parts);

#define PAGEDKV_DECLARE_CPU_GEMM_KERNELS(capability) \
  namespace capability {                            \
  void packed_linear(const PackedLinearBatch& batch); \
  }

PAGEDKV_DECLARE_CPU_GEMM_KERNELS(DEFAULT)
PAGEDKV_DECLARE_CPU_GEMM_KERNELS(AVX2)
PAGEDKV_DECLARE_CPU_GEMM_KERNELS(AVX512)
PAGEDKV_DECLARE_CPU_GEMM_KERNELS(AVX512_BF16)

#undef PAGEDKV_DECLARE_CPU_GEMM_KERNELS

// bf16 products of at least this many input rows run on AMX tiles where the CPU has them
// (cpu_amx_enabled): below it the register tiles, which read the panel in several streams,
// are ahead (gemm_amx.cpp).
constexpr int64_t kAmxMinRows = 2;

// The AMX tile loop (gemm_amx.cpp), built into the AVX512_BF16 variant only; bf16 problems.
namespace AVX512_BF16 {
void packed_linear_amx(const PackedLinearBatch& batch);
}

}  // namespace pagedkv::cpu
