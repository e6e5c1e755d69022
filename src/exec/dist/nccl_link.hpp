// The collectives of a RoundExchange over NCCL, between the GPUs of the processes of a merge, one
// GPU per process: host bytes are copied to the device, moved by ncclSend/ncclRecv in one group
// (ncclAllGather for the round's header) and copied back. NCCL's unique id reaches the other
// processes through the process group (MPI or the TCP bootstrap). Built with CUDA and nccl.h;
// libnccl itself is loaded at run time (nccl_api.hpp).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "exec/dist/round_exchange.hpp"

namespace shardmerge::dist {

// Whether this process can join an NCCL data plane, and on which GPU.
struct NcclProbe {
  std::string problem;  // empty: it can
  int device = -1;      // the CUDA device it would use: LOCAL_RANK, or 0 where it sees one GPU
  std::string gpu;      // that GPU's UUID, so that two processes on one GPU are found before NCCL refuses them
};
NcclProbe probe_nccl(int local_rank);

// Every process's `mine` and `ok` in, rank 0's `mine` out; throws on every process when any
// process is not ok (ProcessGroup::all_gather's contract).
using ShareId = std::function<std::string(const std::string& mine, bool ok)>;

// Joins the NCCL communicator of `size` processes on CUDA device `device`. Collective: every
// process constructs one; rank 0's NCCL unique id reaches the others through `share_id`. An
// operation that makes no progress for `peer_timeout_s` (a peer stopped, or its link down: NCCL
// itself would wait for ever) aborts the communicator and fails (--peer-timeout).
std::unique_ptr<PeerLink> make_nccl_link(int rank, int size, int device, const ShareId& share_id, double peer_timeout_s);

}  // namespace shardmerge::dist
