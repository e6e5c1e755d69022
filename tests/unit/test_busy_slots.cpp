// The CUDA runner's output-slot bookkeeping (exec/cuda/busy_slots.hpp), host-only: a slot
// freed by another thread wakes the waiter, and every notify happens while the lock is held
// (the runner is destroyed as soon as its last wait returns, so a notify after unlocking could
// touch a destroyed condition variable).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "exec/cuda/busy_slots.hpp"

namespace shardmerge::cuda {
namespace {

thread_local int locks_held = 0;
std::atomic<int> notifies_without_lock{0};

// A mutex that counts, per thread, how many of it the thread holds.
class CountingMutex {
 public:
  void lock() {
    m_.lock();
    ++locks_held;
  }
  bool try_lock() {
    if (!m_.try_lock()) return false;
    ++locks_held;
    return true;
  }
  void unlock() {
    --locks_held;
    m_.unlock();
  }

 private:
  std::mutex m_;
};

// A condition variable that records notifies from a thread holding no CountingMutex.
class CheckedCondVar : public std::condition_variable_any {
 public:
  void notify_all() noexcept {
    if (locks_held == 0) ++notifies_without_lock;
    std::condition_variable_any::notify_all();
  }
  void notify_one() noexcept {
    if (locks_held == 0) ++notifies_without_lock;
    std::condition_variable_any::notify_one();
  }
};

TEST(CudaBusySlots, ReleasesFromOtherThreadsWakeTheWaiterAndNotifyUnderTheLock) {
  notifies_without_lock = 0;
  for (int round = 0; round < 200; ++round) {
    auto slots = std::make_unique<BusySlots<CountingMutex, CheckedCondVar>>(3);
    for (size_t i = 0; i < 3; ++i) slots->acquire(i);
    std::vector<std::thread> writers;
    for (size_t i = 0; i < 3; ++i) writers.emplace_back([&slots, i] { slots->release(i); });
    slots->wait_all_free();
    slots->acquire(1);  // free again: does not wait
    slots->release(1);
    for (auto& w : writers) w.join();
  }
  EXPECT_EQ(notifies_without_lock.load(), 0) << "release() notified after unlocking: the runner may be gone by then";
}

TEST(CudaBusySlots, AcquireWaitsForTheSlotToBeReleased) {
  BusySlots<> slots(1);
  slots.acquire(0);
  std::atomic<bool> released{false};
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    released = true;
    slots.release(0);
  });
  slots.acquire(0);
  EXPECT_TRUE(released.load());
  writer.join();
}

}  // namespace
}  // namespace shardmerge::cuda
