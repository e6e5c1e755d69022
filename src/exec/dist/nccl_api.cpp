#include "exec/dist/nccl_api.hpp"

#include <dlfcn.h>

#include <mutex>

#include "shardmerge/error.hpp"

namespace shardmerge::dist {
namespace {

const std::string kLibrary = "libnccl.so." + std::to_string(NCCL_MAJOR);

template <class F>
void resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(::dlsym(lib, name));
  if (!f) throw Error(kLibrary + " has no " + name + " (an NCCL older than the one shardmerge was built with?)");
}

NcclApi load() {
  void* lib = ::dlopen(kLibrary.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    throw Error("moving slices between GPUs needs " + kLibrary + ", which cannot be loaded (" + (why ? why : "not found") +
                "); add the CUDA toolkit's or the nvidia-nccl wheel's lib directory to LD_LIBRARY_PATH");
  }
  NcclApi api{};
  resolve(lib, "ncclGetVersion", api.get_version);
  resolve(lib, "ncclGetUniqueId", api.get_unique_id);
  resolve(lib, "ncclCommInitRank", api.comm_init_rank);
  resolve(lib, "ncclCommDestroy", api.comm_destroy);
  resolve(lib, "ncclAllGather", api.all_gather);
  resolve(lib, "ncclSend", api.send);
  resolve(lib, "ncclRecv", api.recv);
  resolve(lib, "ncclGroupStart", api.group_start);
  resolve(lib, "ncclGroupEnd", api.group_end);
  resolve(lib, "ncclGetErrorString", api.error_string);
  resolve(lib, "ncclGetLastError", api.last_error);
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

const NcclApi& nccl() {
  static std::once_flag once;
  static NcclApi api;
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

void check_nccl(ncclResult_t result, const std::string& what, ncclComm_t comm) {
  if (result == ncclSuccess) return;
  std::string text = std::string("NCCL: ") + what + " failed: " + nccl().error_string(result);
  const char* last = nccl().last_error(comm);
  if (last && *last) text += std::string(" (") + last + ")";
  throw Error(text);
}

}  // namespace shardmerge::dist
