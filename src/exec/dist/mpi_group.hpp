// The MPI transport of a multi-process merge (mpirun, srun): control messages are MPI
// collectives on one communicator, the data plane point-to-point messages on a second, and
// liveness pings on a third. A read of a source another process owns is a request to that
// process and the bytes in reply; many reads are in flight at once (one per executor thread),
// each owner answers on several threads and never waits for one reply to arrive before serving
// the next, so that the link, not its round trip, bounds a merge across nodes. One progress
// thread polls MPI for all of them (mpi_progress.hpp); MPI runs with MPI_THREAD_MULTIPLE.
//
// A process that dies takes the job down through the launcher (mpirun, srun), which names it.
// A process that stops answering (stopped, or its link down) is found by the pings: any wait
// on a peer pings it, and a peer silent for the peer timeout fails this process with its rank
// and host; the job is then aborted through MPI, so the launcher ends every process.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "exec/dist/process_group.hpp"

namespace shardmerge::dist {

class MpiProgress;

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
  bool peer_lost() const override;

 private:
  using Clock = std::chrono::steady_clock;
  std::string name() const override { return "MPI"; }
  void read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) override;
  unsigned reads_in_flight() const override;
  void begin_serving(Serve serve) override;
  void end_serving() override;
  uint64_t bytes_served() const override { return served_.load(); }
  void serve_requests();
  void answer_pings();
  void stop_threads();  // the serving threads, the pinger, then the progress thread
  // Pings the peers that have been silent for a while; throws for one silent past the timeout.
  void check_alive(const std::vector<int>& peers);
  std::vector<int> peers() const;
  std::string who(int rank) const;  // "process rank R on host H"

  struct Communicators;
  std::unique_ptr<Communicators> comms_;
  std::unique_ptr<MpiProgress> progress_;
  std::vector<std::string> hosts_;
  int tag_limit_ = 32767;
  std::atomic<uint32_t> next_tag_{0};
  Clock::duration peer_timeout_, ping_interval_;

  struct PeerState {
    Clock::time_point heard;  // its last answer to a ping (or the group's start)
    Clock::time_point ping_sent;
    bool ping_out = false;
  };
  std::mutex peers_mutex_;
  std::vector<PeerState> peer_state_;
  std::thread pinger_;

  Serve serve_;
  std::vector<std::thread> servers_;
  std::mutex serving_mutex_;
  std::condition_variable serving_cv_;  // replies in flight fell, or a peer is done, or stop
  uint64_t reply_bytes_in_flight_ = 0;
  std::vector<std::vector<char>> spare_buffers_;
  std::vector<bool> peer_done_;
  bool stopping_ = false;
  std::atomic<uint64_t> served_{0};
};

}  // namespace shardmerge::dist
