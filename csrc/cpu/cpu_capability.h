// Which instruction-set variant of the CPU attention kernels runs.
//
// csrc/cpu/attention_kernels.cpp is compiled once per capability (CMakeLists.txt:
// DEFAULT, AVX2 with FMA/F16C, AVX-512, and AVX-512 with AVX512-BF16, whose
// translation unit holds only the bf16 kernels: their Q.K^T dot products use
// vdpbf16ps; fp32/fp16 inputs run the AVX-512 kernels). The best one the CPU
// supports is picked once per process. PAGEDKV_CPU_CAPABILITY=default|avx2|avx512|
// avx512_bf16 forces a variant (for testing the fallbacks and benchmarking the
// bf16 dot products against the AVX-512 path, or to avoid AVX-512 frequency
// drops); asking for one the CPU lacks is an error rather than a crash on an
// illegal instruction. `torch.ops.pagedkv.cpu_capability()` returns the name of
// the variant in use, `set_cpu_capability(name)` switches it (tests, benchmarks).
#pragma once

#include <string>

namespace pagedkv::cpu {

enum class CpuCapability { kDefault, kAvx2, kAvx512, kAvx512Bf16 };

// The variant in use (decided on first call from the CPU and PAGEDKV_CPU_CAPABILITY,
// then cached; set_cpu_capability_op changes it).
CpuCapability selected_cpu_capability();

const char* cpu_capability_name(CpuCapability capability);

// Backs the `cpu_capability() -> str` op (schema in torch_bindings.cpp).
std::string cpu_capability_op();

// Backs `set_cpu_capability(str name) -> str`: switches the variant for the whole
// process (checked against the CPU like the environment override) and returns the
// previous one. Not meant to be called while kernels run on other threads.
std::string set_cpu_capability_op(const std::string& name);

// Whether bf16 GEMMs of many rows and bf16 prefill attention run on AMX tiles
// (csrc/cpu/gemm_amx.cpp, csrc/cpu/attention_amx.cpp): the CPU has
// AMX-TILE and AMX-BF16, Linux granted this process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM), the variant in use is avx512_bf16, and neither PAGEDKV_CPU_AMX=0
// nor set_cpu_amx(false) turned it off. Backs the `cpu_amx() -> bool` op.
bool cpu_amx_enabled();
// Backs `set_cpu_amx(bool enabled) -> bool`: turns the AMX path on or off process-wide
// (enabling it on a CPU without AMX is an error) and returns the previous setting.
bool set_cpu_amx_op(bool enabled);

// Whether the avx512_bf16 variant's decode takes Q.K^T on vdpbf16ps rather than on fp32 FMAs
// (a bf16 cache at head sizes that are multiples of 32, an fp8 one at multiples of 64; where
// it is off, an int8 cache's P.V runs on paired codes at every head size). vdpbf16ps does twice an FMA's
// products but its throughput differs by CPU: about one FMA's time on AMD Zen 4, four on Intel
// Sapphire Rapids (where the FMAs then do twice the products per second). So it is measured
// once per process (bf16_dot_cost) and taken where it costs under two FMAs;
// PAGEDKV_CPU_BF16_DOT=0 or 1 decides instead. Backs the `cpu_bf16_dot() -> bool` op.
bool cpu_bf16_dot_enabled();
// Backs `set_cpu_bf16_dot(bool enabled) -> bool`: sets it process-wide, returns the previous setting.
bool set_cpu_bf16_dot_op(bool enabled);

// Runs the kernel of the variant this process selected, out of one per variant (a file
// built without an AVX512_BF16 unit passes its AVX512 kernel twice).
template <typename Params>
void run_variant(const Params& params, void (*avx512_bf16)(const Params&), void (*avx512)(const Params&),
                 void (*avx2)(const Params&), void (*fallback)(const Params&)) {
  switch (selected_cpu_capability()) {
    case CpuCapability::kAvx512Bf16:
      return avx512_bf16(params);
    case CpuCapability::kAvx512:
      return avx512(params);
    case CpuCapability::kAvx2:
      return avx2(params);
    case CpuCapability::kDefault:
      break;
  }
  fallback(params);
}

}  // namespace pagedkv::cpu
