#include "exec/dist/nccl_api.hpp"

#include "shardmerge/error.hpp"
#include "util/loaded_library.hpp"

namespace shardmerge::dist {
namespace {

const std::string kLibrary = "libnccl.so." + std::to_string(NCCL_MAJOR);

NcclApi load() {
  void* lib = open_library(kLibrary, "moving slices between GPUs",
                           "add the CUDA toolkit's or the nvidia-nccl wheel's lib directory to LD_LIBRARY_PATH");
  NcclApi api{};
  resolve_symbol(lib, kLibrary, "ncclGetVersion", api.get_version);
  resolve_symbol(lib, kLibrary, "ncclGetUniqueId", api.get_unique_id);
  resolve_symbol(lib, kLibrary, "ncclCommInitRank", api.comm_init_rank);
  resolve_symbol(lib, kLibrary, "ncclCommDestroy", api.comm_destroy);
  resolve_symbol(lib, kLibrary, "ncclCommAbort", api.comm_abort);
  resolve_symbol(lib, kLibrary, "ncclCommGetAsyncError", api.comm_get_async_error);
  resolve_symbol(lib, kLibrary, "ncclAllGather", api.all_gather);
  resolve_symbol(lib, kLibrary, "ncclSend", api.send);
  resolve_symbol(lib, kLibrary, "ncclRecv", api.recv);
  resolve_symbol(lib, kLibrary, "ncclGroupStart", api.group_start);
  resolve_symbol(lib, kLibrary, "ncclGroupEnd", api.group_end);
  resolve_symbol(lib, kLibrary, "ncclGetErrorString", api.error_string);
  resolve_symbol(lib, kLibrary, "ncclGetLastError", api.last_error);
  return api;
}

}  // namespace

const NcclApi& nccl() { return load_once<load>(); }

void check_nccl(ncclResult_t result, const std::string& what, ncclComm_t comm) {
  if (result == ncclSuccess) return;
  std::string text = std::string("NCCL: ") + what + " failed: " + nccl().error_string(result);
  const char* last = nccl().last_error(comm);
  if (last && *last) text += std::string(" (") + last + ")";
  throw Error(text);
}

}  // namespace shardmerge::dist
