// Pinning the CPU compute threads: each of torch's OpenMP threads to one CPU.
//
// An engine process that shares its machine with a front end (the HTTP server,
// the benchmark client) loses time at every parallel region whenever one of
// its compute threads is moved or descheduled; binding thread i to cpus[i]
// keeps each thread's caches warm and makes the loss visible as a fixed core.
// The caller also sets the process's affinity (os.sched_setaffinity), so the
// threads torch starts later stay on the same CPUs.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedkv::cpu {

// Sets torch's intra-op thread count to cpus.size() and binds OpenMP thread i to
// cpus[i]. Returns the CPU each thread reports it runs on afterwards.
// Backs the `bind_cpu_threads(int[] cpus) -> int[]` op (schema in torch_bindings.cpp).
std::vector<int64_t> bind_cpu_threads(const std::vector<int64_t>& cpus);

}  // namespace pagedkv::cpu
