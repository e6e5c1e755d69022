// One thread drives MPI for every thread of the process that waits on it. Open MPI's blocking
// calls spin a core each, and so does an MPI_Test loop: with a dozen reads in flight and the
// serving threads beside them, polling alone cost several times the merge's own CPU. Here the
// waiting threads sleep on a condition variable, and one thread tests all pending requests at
// once (MPI_Testsome), sleeping between rounds: briefly while messages complete, longer the
// longer nothing does, so that a process waiting on a stopped peer uses no measurable CPU.
#pragma once

#define OMPI_SKIP_MPICXX 1  // the C API only (the C++ bindings need a library we do not link)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace shardmerge::dist {

class MpiProgress {
 public:
  MpiProgress();
  ~MpiProgress();  // stops the thread; requests still pending are left to MPI
  MpiProgress(const MpiProgress&) = delete;
  MpiProgress& operator=(const MpiProgress&) = delete;

  // Blocks until `request` completes and returns its status. Four times a second of waiting it
  // calls `still_waiting` (a liveness check), which may throw: the error goes to the caller,
  // and a point-to-point receive (`receive`) is cancelled first, since its buffer is about to
  // go (MPI forbids cancelling a collective, and cancelling a send is deprecated).
  enum class Kind { Send, Receive, Collective };
  MPI_Status wait(MPI_Request request, Kind kind, const std::function<void()>& still_waiting = {});
  // Completes `request` in the background, then calls `done` on the progress thread (a send
  // whose buffer `done` releases).
  void detach(MPI_Request request, std::function<void()> done = {});

 private:
  struct Pending;
  void drive();

  std::mutex mutex_;
  std::condition_variable work_;  // the progress thread: a new request, or stop
  std::condition_variable done_;  // the waiting threads: some request completed
  std::vector<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace shardmerge::dist
