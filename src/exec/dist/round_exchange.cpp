#include "exec/dist/round_exchange.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "shardmerge/error.hpp"

namespace shardmerge::dist {
namespace {

// One piece asked of an owner, as it travels.
struct WireRequest {
  uint32_t file;
  uint32_t reserved;
  uint64_t offset;
  uint64_t n;
};

// The bytes of each peer's container (a vector of records, a string), as all_to_all takes them.
template <typename Container>
std::vector<std::span<const char>> bytes_of(const std::vector<Container>& per_peer) {
  std::vector<std::span<const char>> out;
  for (const auto& v : per_peer) out.emplace_back(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(*v.data()));
  return out;
}

template <typename Container>
std::vector<std::span<char>> writable_bytes_of(std::vector<Container>& per_peer) {
  std::vector<std::span<char>> out;
  for (auto& v : per_peer) out.emplace_back(reinterpret_cast<char*>(v.data()), v.size() * sizeof(*v.data()));
  return out;
}

// An owner's disk reads for one round run on a few threads: one pread stream leaves an NVMe
// drive mostly idle.
constexpr unsigned kServingThreads = 4;

struct ServedRound {
  std::vector<std::vector<std::string>> errors;  // per asking process, per request: empty, or why not
  std::vector<std::span<const char>> data;       // per asking process: its requests' bytes in `send`
  uint64_t bytes = 0;                            // read and sent
};

// Reads every request of `asked` into `send`, packed in order (a failed one leaves its bytes
// unset and its error's text instead).
ServedRound serve_requests(const DataPlane::Serve& serve, const std::vector<std::vector<WireRequest>>& asked, char* send) {
  struct Job {
    const WireRequest* request;
    char* out;
    std::string* error;
  };
  ServedRound served;
  served.errors.resize(asked.size());
  std::vector<Job> jobs;
  uint64_t at = 0;
  for (size_t r = 0; r < asked.size(); ++r) {
    const uint64_t start = at;
    served.errors[r].resize(asked[r].size());
    for (size_t i = 0; i < asked[r].size(); ++i) {
      jobs.push_back(Job{&asked[r][i], send + at, &served.errors[r][i]});
      at += asked[r][i].n;
    }
    served.data.emplace_back(send + start, at - start);
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  auto work = [&] {
    for (size_t j = next++; j < jobs.size(); j = next++) {
      const WireRequest& q = *jobs[j].request;
      try {
        serve(q.file, q.offset, jobs[j].out, q.n);
        bytes += q.n;
      } catch (const std::exception& e) {
        *jobs[j].error = *e.what() ? e.what() : "unknown error";
      }
    }
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < std::min<size_t>(kServingThreads, jobs.size()); ++t) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
  served.bytes = bytes;
  return served;
}

}  // namespace

struct RoundExchange::Read {
  size_t left = 0;
  std::string failure;  // the first piece's that failed
};

RoundExchange::RoundExchange(std::unique_ptr<PeerLink> link, uint64_t round_bytes)
    : link_(std::move(link)),
      round_bytes_(round_bytes),
      owner_bytes_(std::min(round_bytes, std::max<uint64_t>(1ull << 20, round_bytes / static_cast<uint64_t>(
                                                                                    std::max(1, link_->size() - 1))))) {}

RoundExchange::~RoundExchange() {
  if (thread_.joinable()) {
    try {
      end_serving();
    } catch (...) {  // the job is failing already
    }
  }
}

uint64_t RoundExchange::bytes_served() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return served_;
}

void RoundExchange::begin_serving(Serve serve) {
  if (thread_.joinable()) throw Error("the " + name() + " data plane is serving already");
  serve_ = std::move(serve);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    serving_ = true;
    ending_ = false;
  }
  thread_ = std::thread([this] { run(); });
}

void RoundExchange::end_serving() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ending_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void RoundExchange::read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) {
  if (owner < 0 || owner >= link_->size())
    throw Error("asked process rank " + std::to_string(owner) + " for a source; there are " + std::to_string(link_->size()));
  if (n == 0) return;
  Read r;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!serving_ || ending_) throw Error("the " + name() + " data plane is not running: no source can be read from another process");
    auto* out = static_cast<char*>(buf);
    for (uint64_t done = 0; done < n; done += owner_bytes_) {
      const uint64_t piece = std::min<uint64_t>(owner_bytes_, n - done);
      queue_.push_back(Piece{owner, file, offset + done, piece, out + done, &r});
      ++r.left;
    }
  }
  work_.notify_all();
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return r.left == 0; });
  if (!r.failure.empty()) throw Error(r.failure);
}

void RoundExchange::run() {
  try {
    // While no process asks anything, rounds slow down to one per millisecond at most, and
    // speed up again as soon as a piece is queued here (or anywhere: the others' rounds wait).
    auto idle = std::chrono::microseconds(0);
    for (RoundResult r = round(); r != RoundResult::Over; r = round()) {
      if (r == RoundResult::Moved) {
        idle = std::chrono::microseconds(0);
        continue;
      }
      idle = std::clamp(idle * 2, std::chrono::microseconds(20), std::chrono::microseconds(1000));
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait_for(lock, idle, [&] { return !queue_.empty() || ending_; });
    }
  } catch (const std::exception& e) {
    // The other processes wait in this round's collectives, and would wait for ever: stop this
    // process, so that the launcher (mpirun, srun, torchrun) stops the job and names it.
    std::fprintf(stderr, "shardmerge: process rank %d: the %s data plane failed: %s; stopping this process\n",
                 link_->rank(), link_->name().c_str(), e.what());
    std::fflush(stderr);
    std::_Exit(1);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  serving_ = false;
}

std::vector<std::vector<RoundExchange::Piece>> RoundExchange::take_pieces() {
  std::vector<std::vector<Piece>> asked(static_cast<size_t>(link_->size()));
  std::vector<uint64_t> per_owner(asked.size(), 0);
  uint64_t total = 0;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (total + it->n > round_bytes_) break;  // first come, first asked
    uint64_t& owner = per_owner[static_cast<size_t>(it->owner)];
    if (owner + it->n > owner_bytes_) {
      ++it;
      continue;
    }
    owner += it->n;
    total += it->n;
    asked[static_cast<size_t>(it->owner)].push_back(*it);
    it = queue_.erase(it);
  }
  return asked;
}

RoundExchange::RoundResult RoundExchange::round() {
  const int size = link_->size(), me = link_->rank();
  const auto peers = static_cast<size_t>(size);
  const auto cols = peers + 1;
  std::vector<std::vector<Piece>> asked = take_pieces();

  // 1. Who asks whom for how many pieces, and who reads nothing more.
  std::vector<uint64_t> header(cols, 0), all(peers * cols, 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    header[0] = ending_ && queue_.empty() ? 1 : 0;
  }
  for (size_t p = 0; p < peers; ++p) header[1 + p] = asked[p].size();
  link_->all_gather(header.data(), header.size() * sizeof(uint64_t), all.data());
  bool everyone_done = true;
  uint64_t pieces = 0;
  for (size_t r = 0; r < peers; ++r) {
    everyone_done = everyone_done && all[r * cols] != 0;
    for (size_t p = 0; p < peers; ++p) pieces += all[r * cols + 1 + p];
  }
  if (pieces == 0) return everyone_done ? RoundResult::Over : RoundResult::Idle;

  // 2. The requests.
  std::vector<std::vector<WireRequest>> requests_out(peers), requests_in(peers);
  for (size_t p = 0; p < peers; ++p)
    for (const Piece& piece : asked[p]) requests_out[p].push_back(WireRequest{piece.file, 0, piece.offset, piece.n});
  for (size_t r = 0; r < peers; ++r) requests_in[r].resize(all[r * cols + 1 + static_cast<size_t>(me)]);
  link_->all_to_all(bytes_of(requests_out), writable_bytes_of(requests_in));

  // 3. Read what was asked of this process; an error's text goes back in place of the bytes.
  uint64_t asked_of_me = 0;
  for (const auto& in : requests_in)
    for (const WireRequest& q : in) {
      if (q.n > owner_bytes_) throw Error("a process asked for " + std::to_string(q.n) + " bytes in one piece, more than a round carries");
      asked_of_me += q.n;
    }
  char* send = link_->host_buffer(0, asked_of_me);
  const ServedRound served = serve_requests(serve_, requests_in, send);
  std::vector<std::vector<uint32_t>> status_out(peers), status_in(peers);
  std::vector<std::string> text_out(peers), text_in(peers);
  for (size_t r = 0; r < peers; ++r)
    for (const std::string& error : served.errors[r]) {
      status_out[r].push_back(static_cast<uint32_t>(error.size()));
      text_out[r] += error;
    }
  for (size_t p = 0; p < peers; ++p) status_in[p].resize(asked[p].size());
  link_->all_to_all(bytes_of(status_out), writable_bytes_of(status_in));

  // 4. The bytes, then the texts of the reads that failed.
  uint64_t expected = 0;
  for (const auto& a : asked)
    for (const Piece& piece : a) expected += piece.n;
  char* recv = link_->host_buffer(1, expected);
  std::vector<std::span<char>> data_in(peers);
  uint64_t cursor = 0;
  for (size_t p = 0; p < peers; ++p) {
    const uint64_t start = cursor;
    uint64_t text = 0;
    for (size_t i = 0; i < asked[p].size(); ++i) cursor += asked[p][i].n, text += status_in[p][i];
    data_in[p] = std::span<char>(recv + start, cursor - start);
    text_in[p].resize(text);
  }
  link_->all_to_all(served.data, data_in);
  link_->all_to_all(bytes_of(text_out), writable_bytes_of(text_in));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    served_ += served.bytes;
  }
  finish(asked, status_in, data_in, text_in);
  return RoundResult::Moved;
}

void RoundExchange::finish(const std::vector<std::vector<Piece>>& asked, const std::vector<std::vector<uint32_t>>& status,
                           const std::vector<std::span<char>>& data, const std::vector<std::string>& texts) {
  std::vector<std::pair<Read*, std::string>> failures;
  for (size_t p = 0; p < asked.size(); ++p) {
    uint64_t at = 0, text_at = 0;
    for (size_t i = 0; i < asked[p].size(); ++i) {
      const Piece& piece = asked[p][i];
      if (status[p][i] == 0) {
        std::memcpy(piece.out, data[p].data() + at, piece.n);
      } else {
        failures.emplace_back(piece.read, "process rank " + std::to_string(p) + ", which holds this source, could not read it: " +
                                              texts[p].substr(text_at, status[p][i]));
        text_at += status[p][i];
      }
      at += piece.n;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [read, text] : failures)
      if (read->failure.empty()) read->failure = std::move(text);
    for (const auto& a : asked)
      for (const Piece& piece : a) --piece.read->left;
  }
  done_.notify_all();
}

}  // namespace shardmerge::dist
