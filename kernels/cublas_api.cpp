#include "kernels/cublas_api.hpp"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "shardmerge/error.hpp"

namespace shardmerge::cuda {
namespace {

const std::string kLibrary = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);

template <class F>
void resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(::dlsym(lib, name));
  if (!f) throw Error(kLibrary + " has no " + name + " (a cuBLAS older than the one shardmerge was built with?)");
}

CublasApi load() {
  void* lib = ::dlopen(kLibrary.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    throw Error("the CUDA executor's LoRA fold needs " + kLibrary + ", which cannot be loaded (" +
                (why ? why : "not found") + "); add the CUDA toolkit's lib directory to LD_LIBRARY_PATH");
  }
  CublasApi api{};
  resolve(lib, "cublasCreate_v2", api.create);
  resolve(lib, "cublasDestroy_v2", api.destroy);
  resolve(lib, "cublasSetStream_v2", api.set_stream);
  resolve(lib, "cublasSetWorkspace_v2", api.set_workspace);
  resolve(lib, "cublasSetMathMode", api.set_math_mode);
  resolve(lib, "cublasSgemm_v2", api.sgemm);
  resolve(lib, "cublasGetStatusName", api.status_name);
  resolve(lib, "cublasGetStatusString", api.status_string);
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

const CublasApi& cublas() {
  static std::once_flag once;
  static CublasApi api;
  static std::exception_ptr failure;
  std::call_once(once, [] {
    try {
      api = load();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (failure) std::rethrow_exception(failure);
  return api;
}

}  // namespace shardmerge::cuda
