// The NCCL data plane's rounds (exec/dist/round_exchange.hpp), with the processes as threads of
// this test and a link that moves bytes between them through shared memory; the byte oracle is
// exchange_world.hpp's.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstring>

#include "exchange_world.hpp"

namespace shardmerge {
namespace {

using testing::run_world;
using testing::WorldOptions;

// What the threads' links share: one slot per process, and a barrier for each step.
struct ThreadFabric {
  explicit ThreadFabric(int size) : size(size), barrier(size), gather(static_cast<size_t>(size)), posted(static_cast<size_t>(size)) {}
  int size;
  std::barrier<> barrier;
  std::vector<const void*> gather;
  std::vector<std::vector<std::span<const char>>> posted;
  std::atomic<uint64_t> most_sent{0};  // the most bytes one process sent in one all-to-all
  std::atomic<uint64_t> mismatches{0};  // receives whose size differs from the matching send
};

class ThreadLink final : public dist::PeerLink {
 public:
  ThreadLink(ThreadFabric& fabric, int rank) : fabric_(fabric), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return fabric_.size; }
  std::string name() const override { return "threads"; }
  void all_gather(const void* mine, size_t n, void* all) override {
    fabric_.gather[static_cast<size_t>(rank_)] = mine;
    fabric_.barrier.arrive_and_wait();
    for (int r = 0; r < fabric_.size; ++r) std::memcpy(static_cast<char*>(all) + n * static_cast<size_t>(r), fabric_.gather[static_cast<size_t>(r)], n);
    fabric_.barrier.arrive_and_wait();
  }
  void all_to_all(const std::vector<std::span<const char>>& send, const std::vector<std::span<char>>& recv) override {
    uint64_t sent = 0;
    for (const auto& s : send) sent += s.size();
    uint64_t seen = fabric_.most_sent.load();
    while (sent > seen && !fabric_.most_sent.compare_exchange_weak(seen, sent)) {
    }
    fabric_.posted[static_cast<size_t>(rank_)] = send;
    fabric_.barrier.arrive_and_wait();
    for (int p = 0; p < fabric_.size; ++p) {
      const std::span<const char> from = fabric_.posted[static_cast<size_t>(p)][static_cast<size_t>(rank_)];
      const std::span<char> to = recv[static_cast<size_t>(p)];
      if (from.size() != to.size()) ++fabric_.mismatches;
      if (const size_t n = std::min(from.size(), to.size())) std::memcpy(to.data(), from.data(), n);
    }
    fabric_.barrier.arrive_and_wait();
  }
  char* host_buffer(int slot, size_t n) override {
    auto& b = buffers_.at(static_cast<size_t>(slot));
    if (b.size() < n) b.resize(n);
    return b.data();
  }

 private:
  ThreadFabric& fabric_;
  int rank_;
  std::array<std::vector<char>, 2> buffers_;
};

testing::WorldResult run_threads(const WorldOptions& o, ThreadFabric& fabric) {
  return run_world(o, [&](int rank) { return std::make_unique<ThreadLink>(fabric, rank); });
}

uint64_t sum(const std::vector<uint64_t>& v) {
  uint64_t s = 0;
  for (uint64_t x : v) s += x;
  return s;
}

TEST(RoundExchange, ProcessesReadEachOthersSourcesInBoundedRounds) {
  WorldOptions o;  // 3 processes x 3 readers, reads up to 9 MiB: split into pieces of 2 MiB
  o.round_bytes = 4 << 20;
  o.max_read = 9 << 20;
  ThreadFabric fabric(o.size);
  const auto r = run_threads(o, fabric);
  EXPECT_TRUE(r.failures.empty()) << r.failures.front();
  EXPECT_EQ(r.wrong_bytes, 0u);
  EXPECT_EQ(fabric.mismatches.load(), 0u);
  EXPECT_GT(sum(r.fetched), 150ull << 20);
  EXPECT_EQ(sum(r.served), sum(r.fetched));
  for (int rank = 0; rank < o.size; ++rank) EXPECT_GT(r.served[static_cast<size_t>(rank)], 0u) << rank;
  // A round carries at most round_bytes of data from any process (requests are a few KiB more).
  EXPECT_LE(fabric.most_sent.load(), o.round_bytes);
  EXPECT_GT(fabric.most_sent.load(), o.round_bytes / 2);  // and rounds are filled, not one piece each
}

TEST(RoundExchange, AProcessThatReadsNothingKeepsServingUntilEveryoneIsDone) {
  WorldOptions o;
  o.size = 4;
  o.idle = {0, 2};  // end_serving at once; their files are still read by 1 and 3
  ThreadFabric fabric(o.size);
  const auto r = run_threads(o, fabric);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(r.wrong_bytes, 0u);
  EXPECT_EQ(r.fetched[0] + r.fetched[2], 0u);
  EXPECT_GT(r.served[0], 0u);
  EXPECT_GT(r.served[2], 0u);
  EXPECT_EQ(sum(r.served), sum(r.fetched));
}

TEST(RoundExchange, AnOwnersErrorReachesTheReaderAndOtherReadsGoOn) {
  WorldOptions o;
  o.failing_file = 5;  // owned by rank 2
  o.max_read = 64 << 10;
  ThreadFabric fabric(o.size);
  const auto r = run_threads(o, fabric);
  ASSERT_FALSE(r.failures.empty());
  for (const std::string& f : r.failures) {
    EXPECT_NE(f.find("process rank 2, which holds this source, could not read it: "), std::string::npos) << f;
    EXPECT_NE(f.find("disk on fire"), std::string::npos) << f;
    EXPECT_NE(f.find("/ckpt/file5"), std::string::npos) << f;
  }
  EXPECT_EQ(r.wrong_bytes, 0u);
  EXPECT_GT(sum(r.fetched), 0u);
}

TEST(RoundExchange, OneProcessCanAskItself) {
  WorldOptions o;
  o.size = 1;
  o.read_own = true;
  o.threads = 2;
  o.reads = 10;
  ThreadFabric fabric(o.size);
  const auto r = run_threads(o, fabric);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(r.wrong_bytes, 0u);
  EXPECT_EQ(r.served[0], r.fetched[0]);
  EXPECT_GT(r.fetched[0], 0u);
}

TEST(RoundExchange, ReadsOutsideServingAreRefused) {
  ThreadFabric fabric(1);
  dist::RoundExchange plane(std::make_unique<ThreadLink>(fabric, 0));
  char b[4];
  EXPECT_THROW(plane.read(0, 0, 0, b, sizeof b), Error);  // before begin_serving
  EXPECT_THROW(plane.read(1, 0, 0, b, sizeof b), Error);  // no process rank 1
  plane.begin_serving([](uint32_t, uint64_t, void* buf, size_t n) { std::memset(buf, 7, n); });
  plane.read(0, 0, 0, b, sizeof b);
  EXPECT_EQ(b[3], 7);
  plane.end_serving();
  EXPECT_THROW(plane.read(0, 0, 0, b, sizeof b), Error);
}

}  // namespace
}  // namespace shardmerge
