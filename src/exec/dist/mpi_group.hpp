// The MPI transport of a multi-process merge (mpirun, srun): control messages are MPI
// collectives on one communicator, the data plane point-to-point messages on another. A read of
// a source another process owns is a request to that process and the bytes in reply; each
// process answers requests on two serving threads, so MPI runs with MPI_THREAD_MULTIPLE.
// A process that dies takes the job down through the launcher (mpirun, srun), which names it.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "exec/dist/process_group.hpp"

namespace shardmerge::dist {

class MpiProcessGroup : public ProcessGroup, private DataPlane {
 public:
  // Initialises MPI on first use (or takes it as mpi4py initialised it); refuses a library without
  // MPI_THREAD_MULTIPLE, and ranks that disagree with the launcher's variables.
  explicit MpiProcessGroup(const LaunchInfo& info);
  ~MpiProcessGroup() override;  // stops serving if still on (MPI itself is finalised at exit)
  MpiProcessGroup(const MpiProcessGroup&) = delete;
  MpiProcessGroup& operator=(const MpiProcessGroup&) = delete;

  std::string transport() const override { return "MPI"; }
  std::vector<std::string> all_gather(const std::string& mine, bool ok = true) override;
  DataPlane* data_plane() override { return this; }

 private:
  std::string name() const override { return "MPI"; }
  void read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) override;
  void begin_serving(Serve serve) override;
  void end_serving() override;
  uint64_t bytes_served() const override { return served_.load(); }
  void serve_requests();

  struct Communicators;
  std::unique_ptr<Communicators> comms_;
  int tag_limit_ = 32767;
  std::atomic<uint32_t> next_tag_{0};
  Serve serve_;
  std::vector<std::thread> servers_;
  std::atomic<int> done_peers_{0};
  std::atomic<uint64_t> served_{0};
};

}  // namespace shardmerge::dist
