// The TCP bootstrap of a multi-process merge (torchrun, or a build without MPI): rank 0
// listens, the others connect. It carries only control traffic (plan digests, summaries, the
// temp directory name, status, statistics), never tensor bytes.
//
// The port is SHARDMERGE_PORT, else MASTER_PORT + 1: under torchrun, MASTER_PORT itself is
// held by torch's own rendezvous store.
#pragma once

#include <vector>

#include "exec/dist/process_group.hpp"

namespace shardmerge::dist {

class TcpProcessGroup : public ProcessGroup {
 public:
  // Connects all processes (waits up to `timeout_s` for them).
  TcpProcessGroup(const LaunchInfo& info, int timeout_s);
  ~TcpProcessGroup() override;
  TcpProcessGroup(const TcpProcessGroup&) = delete;
  TcpProcessGroup& operator=(const TcpProcessGroup&) = delete;

  std::string transport() const override { return "TCP bootstrap"; }
  std::vector<std::string> all_gather(const std::string& mine, bool ok = true) override;

 private:
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: one socket per other rank (index rank - 1); others: the root
};

}  // namespace shardmerge::dist
