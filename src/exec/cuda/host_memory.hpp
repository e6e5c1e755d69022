// Host memory the CUDA executor needs besides its staging: the CUDA context of each device
// and, for LoRA folds, cuBLAS. --memory-limit bounds the whole process, so these count: the
// executor refuses a limit that cannot hold them before it creates any context (creating one
// would already pass the limit), then measures what they really took and sizes its staging from
// the rest. Host-only, so the CPU unit tests check it.
#pragma once

#include <cstdint>
#include <string>

#include "shardmerge/error.hpp"

namespace shardmerge::cuda {

// ESTIMATES, not measurements of this build: no GPU was available to measure them. A context's
// host RSS (driver state, its mappings of the GPU's memory, kernels loaded so far) is commonly
// reported at a few hundred MiB; this takes 256 MiB per device. cuBLAS: loading it added about
// 220 MB of RSS to a run of this tool (when it was made to load on first use), so 224 MiB.
// The check after the contexts exist uses the measured RSS instead; only this early refusal
// and kLazyKernelHostBytes rest on estimates.
constexpr uint64_t kContextHostBytes = 256ull << 20;
constexpr uint64_t kCublasHostBytes = 224ull << 20;
// Kernels load on their first launch (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2),
// after the RSS is measured: shardmerge's own and cuBLAS's sgemm kernels. An estimate.
constexpr uint64_t kLazyKernelHostBytes = 32ull << 20;

// Host bytes the contexts (and cuBLAS, with folds) are expected to add.
inline uint64_t expected_cuda_host_bytes(uint64_t devices, bool folds) {
  return devices * kContextHostBytes + (folds ? kCublasHostBytes : 0);
}

// Usage error, before any context exists, when `memory_limit` cannot hold what the process has
// now (`rss`), `reserve`, the expected CUDA host memory and `min_staging`.
inline void require_host_memory_for_cuda(uint64_t memory_limit, uint64_t rss, uint64_t reserve, uint64_t min_staging,
                                         uint64_t devices, bool folds) {
  const uint64_t cuda = expected_cuda_host_bytes(devices, folds);
  const uint64_t needed = rss + reserve + cuda + min_staging;
  if (memory_limit >= needed) return;
  auto mib = [](uint64_t b) { return std::to_string((b + (1ull << 20) - 1) >> 20) + " MiB"; };
  throw usage_error("--memory-limit " + mib(memory_limit) + " is below the about " + mib(needed) +
                    " the CUDA executor needs on " + std::to_string(devices) + " device(s): " + mib(cuda) +
                    " of host memory for the CUDA context" + (devices > 1 ? "s" : "") +
                    (folds ? " and cuBLAS (LoRA folds)" : "") + " (an estimate), " + mib(rss + reserve) +
                    " for this process, " + mib(min_staging) + " of staging; raise --memory-limit");
}

}  // namespace shardmerge::cuda
