#include "kernels/cublas_api.hpp"

#include <string>

#include "util/loaded_library.hpp"

namespace shardmerge::cuda {
namespace {

const std::string kLibrary = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);

CublasApi load() {
  void* lib = open_library(kLibrary, "the CUDA executor's LoRA fold", "add the CUDA toolkit's lib directory to LD_LIBRARY_PATH");
  CublasApi api{};
  resolve_symbol(lib, kLibrary, "cublasCreate_v2", api.create);
  resolve_symbol(lib, kLibrary, "cublasDestroy_v2", api.destroy);
  resolve_symbol(lib, kLibrary, "cublasSetStream_v2", api.set_stream);
  resolve_symbol(lib, kLibrary, "cublasSetWorkspace_v2", api.set_workspace);
  resolve_symbol(lib, kLibrary, "cublasSetMathMode", api.set_math_mode);
  resolve_symbol(lib, kLibrary, "cublasSgemm_v2", api.sgemm);
  resolve_symbol(lib, kLibrary, "cublasGetStatusName", api.status_name);
  resolve_symbol(lib, kLibrary, "cublasGetStatusString", api.status_string);
  return api;
}

}  // namespace

const CublasApi& cublas() { return load_once<load>(); }

}  // namespace shardmerge::cuda
