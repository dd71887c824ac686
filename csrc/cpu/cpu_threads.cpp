#include "cpu/cpu_threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <set>

namespace pagedkv::cpu {

std::vector<int64_t> bind_cpu_threads(const std::vector<int64_t>& cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_cpu_threads: expected at least one CPU, got an empty list");
  const int64_t limit = CPU_SETSIZE;
  std::set<int64_t> seen;
  for (int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < limit, "bind_cpu_threads: CPU ", cpu, " is outside [0, ", limit, ")");
    TORCH_CHECK(seen.insert(cpu).second, "bind_cpu_threads: CPU ", cpu, " is listed twice");
  }
  const int n = static_cast<int>(cpus.size());
  at::set_num_threads(n);
  std::vector<int> errors(n, 0);
  std::vector<int64_t> placed(n, -1);
  // One parallel region of exactly n threads: OpenMP reuses these threads for
  // every later region of the same size, so the binding sticks.
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    // pid 0: the calling thread (not the whole process) on Linux.
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      errors[t] = errno;
    }
    placed[t] = sched_getcpu();
  }
  for (int t = 0; t < n; ++t) {
    TORCH_CHECK(errors[t] == 0, "bind_cpu_threads: binding thread ", t, " to CPU ", cpus[t],
                " failed: ", std::strerror(errors[t]), " (is the CPU in this process's affinity mask?)");
  }
  return placed;
}

}  // namespace pagedkv::cpu
