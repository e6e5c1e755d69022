// Which of a device's output slots are busy. The device thread takes a slot for a task and hands
// it to an I/O thread, which frees it once the slot's bytes are written; the device thread waits
// for a slot to come free, and for all of them before it returns. The runner is destroyed right
// after that last wait returns, so release() notifies while it still holds the lock: the waiter
// cannot return (and destroy this object) until the releasing thread is done with it. Notifying
// after unlocking let the waiter wake on an earlier release, see every slot free, and destroy
// the condition variable that the later release was about to notify.
// Host-only (no CUDA), so the CPU unit tests check it; Mutex/CondVar are replaced there to see
// that notifying happens under the lock.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace shardmerge::cuda {

template <typename Mutex = std::mutex, typename CondVar = std::condition_variable>
class BusySlots {
 public:
  explicit BusySlots(size_t count) : busy_(count, false) {}

  // Waits until slot `i` is free, then marks it busy.
  void acquire(size_t i) {
    std::unique_lock<Mutex> lock(mutex_);
    freed_.wait(lock, [&] { return !busy_[i]; });
    busy_[i] = true;
  }
  void release(size_t i) {
    std::lock_guard<Mutex> lock(mutex_);
    busy_[i] = false;
    freed_.notify_all();
  }
  void wait_all_free() {
    std::unique_lock<Mutex> lock(mutex_);
    freed_.wait(lock, [&] { return std::none_of(busy_.begin(), busy_.end(), [](bool b) { return b; }); });
  }

 private:
  Mutex mutex_;
  CondVar freed_;
  std::vector<bool> busy_;
};

}  // namespace shardmerge::cuda
