#include "exec/blas.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "shardmerge/error.hpp"
#include "util/loaded_library.hpp"

namespace shardmerge {
namespace {

// Debian's libopenblas0-pthread (and -openmp, -serial) install these names.
constexpr const char* kLibraries[] = {"libopenblas.so.0", "libopenblas.so", "libcblas.so.3", "libblas.so.3"};

void choose_core_type() {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) ::setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);
  else if (__builtin_cpu_supports("avx2")) ::setenv("OPENBLAS_CORETYPE", "Haswell", 0);
#endif
}

SgemmFn load() {
  choose_core_type();
  std::string tried;
  for (const char* name : kLibraries) {
    void* lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      tried += (tried.empty() ? "" : ", ") + std::string(name);
      continue;
    }
    auto sgemm = reinterpret_cast<SgemmFn>(::dlsym(lib, "cblas_sgemm"));
    if (!sgemm) continue;
    using SetThreads = void (*)(int);
    if (auto set_threads = reinterpret_cast<SetThreads>(::dlsym(lib, "openblas_set_num_threads"))) set_threads(1);
    return sgemm;  // the library stays loaded for the life of the process
  }
  throw Error("the LoRA fold needs a BLAS with cblas_sgemm and none could be loaded (tried " + tried +
              "); install libopenblas0 (Debian: apt install libopenblas0-pthread)");
}

}  // namespace

SgemmFn blas_sgemm() { return load_once<load>(); }

}  // namespace shardmerge
