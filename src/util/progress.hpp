// A progress bar on stderr when it is a terminal (bytes, GB/s, ETA); silent otherwise.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace shardmerge {

class Progress {
 public:
  // total_bytes: the sum add() reaches when the work is done (for a merge, the tensor bytes the
  // executor reports, not the file sizes, which include headers), so the bar ends at 100 %.
  Progress(std::string label, uint64_t total_bytes, bool enabled);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress();

  void add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  uint64_t done() const { return done_.load(std::memory_order_relaxed); }
  void finish();

  // Whether stderr is an interactive terminal.
  static bool stderr_is_tty();

 private:
  void draw(bool final) const;

  std::string label_;
  uint64_t total_;
  std::atomic<uint64_t> done_{0};
  bool enabled_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace shardmerge
