#include "exec/cuda/io_pool.hpp"

#include <exception>
#include <latch>

namespace shardmerge::cuda {

IoPool::IoPool(unsigned threads) {
  for (unsigned i = 0; i < std::max(1u, threads); ++i) threads_.emplace_back([this] { worker(); });
}

IoPool::~IoPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void IoPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void IoPool::run_all(std::vector<std::function<void()>>& jobs) {
  std::latch done(static_cast<std::ptrdiff_t>(jobs.size()));
  std::mutex error_mutex;
  std::exception_ptr error;
  for (auto& job : jobs)
    submit([&job, &done, &error_mutex, &error] {
      try {
        job();
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      done.count_down();
    });
  done.wait();
  if (error) std::rethrow_exception(error);
}

void IoPool::worker() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

}  // namespace shardmerge::cuda
