// Threads for the CUDA executor's blocking file I/O: the preads that fill staging buffers (run
// in parallel and waited for) and the output writes (queued behind the GPU work they wait on).
// A job never waits for another job, so the pool cannot deadlock.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardmerge::cuda {

class IoPool {
 public:
  explicit IoPool(unsigned threads);
  ~IoPool();  // runs what is queued, then joins
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  // Queues a job that handles its own errors.
  void submit(std::function<void()> job);
  unsigned size() const { return static_cast<unsigned>(threads_.size()); }
  // Runs the jobs on the pool and waits for all of them; rethrows the first failure.
  void run_all(std::vector<std::function<void()>>& jobs);

 private:
  void worker();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace shardmerge::cuda
