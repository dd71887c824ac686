#include "cpu/cpu_capability.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace pagedkv::cpu {
namespace {

CpuCapability best_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return CpuCapability::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return CpuCapability::kAvx2;
  }
#endif
  return CpuCapability::kDefault;
}

// The environment override, checked against what the CPU can run.
CpuCapability from_env(const std::string& requested, CpuCapability best) {
  CpuCapability wanted;
  if (requested == "default") {
    wanted = CpuCapability::kDefault;
  } else if (requested == "avx2") {
    wanted = CpuCapability::kAvx2;
  } else if (requested == "avx512") {
    wanted = CpuCapability::kAvx512;
  } else {
    TORCH_CHECK(false, "PAGEDKV_CPU_CAPABILITY must be one of default, avx2, avx512; got '", requested, "'");
  }
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(best), "PAGEDKV_CPU_CAPABILITY=", requested,
              " but this CPU supports at most ", cpu_capability_name(best));
  return wanted;
}

}  // namespace

const char* cpu_capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kAvx512:
      return "avx512";
    case CpuCapability::kAvx2:
      return "avx2";
    case CpuCapability::kDefault:
      break;
  }
  return "default";
}

CpuCapability selected_cpu_capability() {
  static const CpuCapability selected = [] {
    const CpuCapability best = best_supported();
    const char* env = std::getenv("PAGEDKV_CPU_CAPABILITY");
    return (env && *env) ? from_env(env, best) : best;
  }();
  return selected;
}

std::string cpu_capability_op() { return cpu_capability_name(selected_cpu_capability()); }

}  // namespace pagedkv::cpu
