// cuBLAS, loaded when the CUDA executor first needs it (dlopen), not at program start: linking
// libcublas/libcublasLt costs every run ~220 MB of resident memory for their relocations, more
// than a CPU merge uses in all, and the binary must start on machines without them.
#pragma once

#include <cublas_v2.h>

namespace shardmerge::cuda {

// The entry points shardmerge calls, resolved from libcublas.so.<major>.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetWorkspace_v2) set_workspace;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasSgemm_v2) sgemm;
  decltype(&cublasGetStatusName) status_name;
  decltype(&cublasGetStatusString) status_string;
};

// Loads the library once; throws an Error naming the library when it or a symbol is missing.
const CublasApi& cublas();

}  // namespace shardmerge::cuda
