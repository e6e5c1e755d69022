// The processes of one multi-process merge, found from the launcher's environment (torchrun:
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; mpirun: OMPI_COMM_WORLD_* / PMI_*),
// connected by a small TCP bootstrap of ours: rank 0 listens, the others connect. It carries
// only control traffic (plan digests, the temp directory name, status, statistics, and the
// NCCL unique id where NCCL is used).
//
// The port is SHARDMERGE_PORT, else MASTER_PORT + 1: under torchrun, MASTER_PORT itself is
// held by torch's own rendezvous store.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace shardmerge::dist {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string address = "127.0.0.1";
  int port = 29501;
};

// Reads the launcher's variables; nullopt when this is a single-process run.
std::optional<LaunchInfo> launch_from_environment();

class ProcessGroup {
 public:
  // Connects all processes (waits up to `timeout_s` for them).
  explicit ProcessGroup(const LaunchInfo& info, int timeout_s = 120);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return info_.rank; }
  int size() const { return info_.world_size; }
  int local_rank() const { return info_.local_rank; }

  // Every process contributes a blob and gets everyone's, in rank order. A process that
  // failed contributes its error instead (ok = false): then every process throws an Error
  // naming the failed rank and its message, so all stop at the same point.
  std::vector<std::string> all_gather(const std::string& mine, bool ok = true);
  // Rank 0's blob, everywhere (with the same error semantics).
  std::string broadcast(const std::string& from_root, bool ok = true);

 private:
  LaunchInfo info_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: one socket per other rank (index rank - 1); others: the root
};

}  // namespace shardmerge::dist
