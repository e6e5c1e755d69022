// The BLAS sgemm of the CPU LoRA fold, loaded on first use (dlopen of OpenBLAS) rather than
// linked: OpenBLAS picks its kernels from the CPU model when it loads, and on virtual machines
// that hide the model (a "Intel Xeon Processor" with AVX-512) it falls back to its Prescott
// (SSE3) kernels, 4x slower. Loading it ourselves lets us name the core type from the CPU's
// actual features first (OPENBLAS_CORETYPE, unless the user set it).
#pragma once

#include <cblas.h>

namespace shardmerge {

using SgemmFn = decltype(&cblas_sgemm);

// cblas_sgemm, single-threaded per call (the executor's workers run folds in parallel).
// Throws an Error naming the libraries tried when none loads.
SgemmFn blas_sgemm();

}  // namespace shardmerge
