// Which instruction-set variant of the CPU attention kernels runs.
//
// csrc/cpu/attention_kernels.cpp is compiled once per capability (CMakeLists.txt:
// DEFAULT, AVX2 with FMA/F16C, AVX-512); the best one the CPU supports is picked
// once per process. PAGEDKV_CPU_CAPABILITY=default|avx2|avx512 forces a variant
// (for testing the fallbacks, or to avoid AVX-512 frequency drops); asking for
// one the CPU lacks is an error rather than a crash on an illegal instruction.
// `torch.ops.pagedkv.cpu_capability()` returns the name of the variant in use.
#pragma once

#include <string>

namespace pagedkv::cpu {

enum class CpuCapability { kDefault, kAvx2, kAvx512 };

// The variant in use (decided on first call, then cached).
CpuCapability selected_cpu_capability();

const char* cpu_capability_name(CpuCapability capability);

// Backs the `cpu_capability() -> str` op (schema in torch_bindings.cpp).
std::string cpu_capability_op();

}  // namespace pagedkv::cpu
