#include "cpu/cpu_capability.h"

#include "cpu/attention_kernels.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedkv::cpu {
namespace {

CpuCapability best_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    // The bf16 variant also reads int8 caches with vpdpwssd (AVX512-VNNI), which every
    // CPU with AVX512-BF16 has, and fp8 caches through vpermi2b byte tables (AVX512-VBMI),
    // which all but Cooper Lake have (Sapphire Rapids and later, Zen 4 and later); the
    // variant is built with both, so Cooper Lake takes the avx512 one.
    const bool bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
                      __builtin_cpu_supports("avx512vbmi");
    return bf16 ? CpuCapability::kAvx512Bf16 : CpuCapability::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return CpuCapability::kAvx2;
  }
#endif
  return CpuCapability::kDefault;
}

// A requested variant (environment or set_cpu_capability), checked against what the CPU can run.
CpuCapability checked(const std::string& requested, const char* source) {
  CpuCapability wanted;
  if (requested == "default") {
    wanted = CpuCapability::kDefault;
  } else if (requested == "avx2") {
    wanted = CpuCapability::kAvx2;
  } else if (requested == "avx512") {
    wanted = CpuCapability::kAvx512;
  } else if (requested == "avx512_bf16") {
    wanted = CpuCapability::kAvx512Bf16;
  } else {
    TORCH_CHECK(false, source, " must be one of default, avx2, avx512, avx512_bf16; got '", requested, "'");
  }
  const CpuCapability best = best_supported();
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(best), source, "=", requested,
              " but this CPU supports at most ", cpu_capability_name(best));
  return wanted;
}

std::atomic<CpuCapability>& selected() {
  static std::atomic<CpuCapability> value = [] {
    const char* env = std::getenv("PAGEDKV_CPU_CAPABILITY");
    return (env && *env) ? checked(env, "PAGEDKV_CPU_CAPABILITY") : best_supported();
  }();
  return value;
}

// Whether this process may run AMX tile instructions: the CPU has them and Linux (5.16+)
// grants the tile data state on request (without the grant the first tile load faults).
bool amx_supported() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool supported = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
    constexpr long kXfeatureXtiledata = 18;     // the tile data registers
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return supported;
#else
  return false;
#endif
}

// A 0/1 switch from the environment: its value, or nullopt where it is unset or empty.
std::optional<bool> env_switch(const char* name) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  const std::string v(env);
  TORCH_CHECK(v == "0" || v == "1", name, " must be 0 or 1, got '", v, "'");
  return v == "1";
}

std::atomic<bool>& amx_selected() {
  static std::atomic<bool> value = [] {
    if (const std::optional<bool> on = env_switch("PAGEDKV_CPU_AMX")) {
      TORCH_CHECK(!*on || amx_supported(), "PAGEDKV_CPU_AMX=1 but this CPU (or kernel) has no AMX-BF16 tiles");
      return *on;
    }
    return amx_supported();
  }();
  return value;
}

// vdpbf16ps's measured cost in FMAs, below which it does more products per second.
constexpr double kBf16DotBreakEven = 2.0;

std::atomic<bool>& bf16_dot_selected() {
  static std::atomic<bool> value = [] {
    if (const std::optional<bool> on = env_switch("PAGEDKV_CPU_BF16_DOT")) return *on;
    // Only a CPU with AVX512-BF16 can run (and use) it.
    return best_supported() != CpuCapability::kAvx512Bf16 || AVX512_BF16::bf16_dot_cost() < kBf16DotBreakEven;
  }();
  return value;
}

}  // namespace

bool cpu_bf16_dot_enabled() { return bf16_dot_selected().load(std::memory_order_relaxed); }

bool set_cpu_bf16_dot_op(bool enabled) { return bf16_dot_selected().exchange(enabled); }

bool cpu_amx_enabled() {
  return amx_selected().load(std::memory_order_relaxed) && selected_cpu_capability() == CpuCapability::kAvx512Bf16;
}

bool set_cpu_amx_op(bool enabled) {
  TORCH_CHECK(!enabled || amx_supported(), "set_cpu_amx(True): this CPU (or kernel) has no AMX-BF16 tiles");
  return amx_selected().exchange(enabled);
}

const char* cpu_capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kAvx512Bf16:
      return "avx512_bf16";
    case CpuCapability::kAvx512:
      return "avx512";
    case CpuCapability::kAvx2:
      return "avx2";
    case CpuCapability::kDefault:
      break;
  }
  return "default";
}

CpuCapability selected_cpu_capability() { return selected().load(std::memory_order_relaxed); }

std::string cpu_capability_op() { return cpu_capability_name(selected_cpu_capability()); }

std::string set_cpu_capability_op(const std::string& name) {
  const CpuCapability wanted = checked(name, "set_cpu_capability");
  return cpu_capability_name(selected().exchange(wanted));
}

}  // namespace pagedkv::cpu

// Baseline copies of the containers the kernel variants use. The variants' objects, compiled
// with -mavx2 ... -mavx512bf16, share std::vector's inline members with the rest of the
// module, and the linker keeps the first copy it meets; CMakeLists.txt links the variants
// after the baseline objects so that copy is a baseline one, but only if some baseline object
// emitted it, which depends on what the compiler chose to inline there. Instantiating them
// here makes one always exist (tests/test_cpu_variant_link.py checks the module).
template class std::vector<float>;
template class std::vector<int64_t>;
