// NCCL, loaded when a merge first moves slices between GPUs (dlopen), not at program start: the
// binary must start on machines without libnccl, where merges use MPI or no data plane.
#pragma once

#include <nccl.h>

#include <string>

namespace shardmerge::dist {

// The entry points shardmerge calls, resolved from libnccl.so.<major>.
struct NcclApi {
  decltype(&ncclGetVersion) get_version;
  decltype(&ncclGetUniqueId) get_unique_id;
  decltype(&ncclCommInitRank) comm_init_rank;
  decltype(&ncclCommDestroy) comm_destroy;
  decltype(&ncclCommAbort) comm_abort;
  decltype(&ncclCommGetAsyncError) comm_get_async_error;
  decltype(&ncclAllGather) all_gather;
  decltype(&ncclSend) send;
  decltype(&ncclRecv) recv;
  decltype(&ncclGroupStart) group_start;
  decltype(&ncclGroupEnd) group_end;
  decltype(&ncclGetErrorString) error_string;
  decltype(&ncclGetLastError) last_error;
};

// Loads the library once; throws an Error naming the library when it or a symbol is missing.
const NcclApi& nccl();

// Throws an Error naming `what` when `result` is a failure.
void check_nccl(ncclResult_t result, const std::string& what, ncclComm_t comm = nullptr);

}  // namespace shardmerge::dist
