#include "exec/dist/mpi_progress.hpp"

#include <algorithm>
#include <utility>

namespace shardmerge::dist {
namespace {

using Clock = std::chrono::steady_clock;

// How long the progress thread sleeps after a round in which nothing completed. While messages
// flow it polls every few tens of microseconds: TCP receive buffers fill in about that time at
// 10 Gbit/s, and the bytes move only when MPI is polled. After a second without completions
// (a slow or stopped peer) it wakes a hundred times a second.
std::chrono::microseconds idle_sleep(unsigned idle_rounds, Clock::duration since_completion) {
  const auto cap = since_completion < std::chrono::milliseconds(20)  ? std::chrono::microseconds(40)
                   : since_completion < std::chrono::seconds(1)      ? std::chrono::microseconds(1000)
                                                                     : std::chrono::microseconds(10000);
  return std::min(cap, std::chrono::microseconds(1u << std::min(idle_rounds, 14u)));
}

}  // namespace

struct MpiProgress::Pending {
  MPI_Request request;
  MPI_Status status{};
  bool done = false;
  bool cancel = false;  // the waiter gave up: cancel it, once
  std::function<void()> on_done;
};

MpiProgress::MpiProgress() : thread_([this] { drive(); }) {}

MpiProgress::~MpiProgress() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

MPI_Status MpiProgress::wait(MPI_Request request, Kind kind, const std::function<void()>& still_waiting) {
  auto p = std::make_shared<Pending>();
  p->request = request;
  std::unique_lock<std::mutex> lock(mutex_);
  pending_.push_back(p);
  work_.notify_one();
  while (!done_.wait_for(lock, std::chrono::milliseconds(250), [&] { return p->done; })) {
    if (!still_waiting) continue;
    lock.unlock();
    try {
      still_waiting();
    } catch (...) {
      if (kind != Kind::Receive) throw;
      // The peer is gone: a receive into the caller's buffer must not land after it returns.
      // The progress thread cancels it (it alone completes requests, so the handle is still
      // live there); a message already matched cannot be cancelled, so wait a little only.
      lock.lock();
      p->cancel = true;
      work_.notify_one();
      done_.wait_for(lock, std::chrono::seconds(1), [&] { return p->done; });
      throw;
    }
    lock.lock();
  }
  return p->status;
}

void MpiProgress::detach(MPI_Request request, std::function<void()> done) {
  auto p = std::make_shared<Pending>();
  p->request = request;
  p->on_done = std::move(done);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.push_back(std::move(p));
  work_.notify_one();
}

void MpiProgress::drive() {
  std::vector<std::shared_ptr<Pending>> round;
  std::vector<MPI_Request> requests;
  std::vector<int> indices;
  std::vector<MPI_Status> statuses;
  std::vector<std::function<void()>> callbacks;
  unsigned idle_rounds = 0;
  Clock::time_point last_completion = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !pending_.empty(); });
    if (stop_) return;
    round = pending_;
    for (const std::shared_ptr<Pending>& p : round)
      if (std::exchange(p->cancel, false)) MPI_Cancel(&p->request);
    lock.unlock();
    requests.resize(round.size());
    for (size_t i = 0; i < round.size(); ++i) requests[i] = round[i]->request;
    indices.resize(round.size());
    statuses.resize(round.size());
    int completed = 0;
    MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed, indices.data(), statuses.data());
    lock.lock();
    if (completed == MPI_UNDEFINED) completed = 0;
    for (int k = 0; k < completed; ++k) {
      const std::shared_ptr<Pending>& p = round[static_cast<size_t>(indices[static_cast<size_t>(k)])];
      p->status = statuses[static_cast<size_t>(k)];
      p->done = true;
      if (p->on_done) callbacks.push_back(std::move(p->on_done));
      pending_.erase(std::find(pending_.begin(), pending_.end(), p));
    }
    round.clear();
    if (completed > 0) {
      idle_rounds = 0;
      last_completion = Clock::now();
      done_.notify_all();
      lock.unlock();
      for (auto& c : callbacks) c();
      callbacks.clear();
      lock.lock();
      continue;
    }
    // Sleeps, but wakes for a new request: it may be the one to progress next.
    const size_t before = pending_.size();
    work_.wait_for(lock, idle_sleep(idle_rounds++, Clock::now() - last_completion),
                   [&] { return stop_ || pending_.size() != before; });
  }
}

}  // namespace shardmerge::dist
