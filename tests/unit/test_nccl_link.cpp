// The NCCL data plane on real GPUs: the rounds of test_round_exchange.cpp over an NCCL link, each
// "process" a thread of this test on its own GPU (NCCL lets one process drive several). Skips,
// saying why, without NCCL in the build, libnccl, or the GPUs a case needs.
#include <gtest/gtest.h>

#include "exchange_world.hpp"
#ifdef SHARDMERGE_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "exec/dist/nccl_link.hpp"
#endif

namespace shardmerge {
namespace {

#ifdef SHARDMERGE_HAVE_NCCL
int gpus_usable() {
  const dist::NcclProbe probe = dist::probe_nccl(0);
  if (!probe.problem.empty()) return 0;
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// Rank 0's NCCL id to every thread: what the process group's all-gather does between processes.
struct InProcessIdShare {
  explicit InProcessIdShare(int size) : barrier(size) {}
  std::barrier<> barrier;
  std::string id;
  std::string operator()(const std::string& mine, bool ok, int rank) {
    if (!ok) throw Error(mine);
    if (rank == 0) id = mine;
    barrier.arrive_and_wait();
    return id;
  }
};

testing::WorldResult run_on_gpus(const testing::WorldOptions& o) {
  InProcessIdShare share(o.size);
  return testing::run_world(o, [&](int rank) {
    return dist::make_nccl_link(
        rank, o.size, rank, [&, rank](const std::string& mine, bool ok) { return share(mine, ok, rank); }, 300);
  });
}
#endif

TEST(NcclGpuLink, OneGpuMovesAProcessesOwnReadsThroughNccl) {
#ifndef SHARDMERGE_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL (needs the CUDA toolkit's nccl.h)";
#else
  if (gpus_usable() < 1) GTEST_SKIP() << "no GPU, or libnccl cannot be loaded: " << dist::probe_nccl(0).problem;
  testing::WorldOptions o;
  o.size = 1;
  o.read_own = true;
  o.reads = 20;
  const auto r = run_on_gpus(o);
  EXPECT_TRUE(r.failures.empty()) << r.failures.front();
  EXPECT_EQ(r.wrong_bytes, 0u);
  EXPECT_GT(r.fetched[0], 0u);
  EXPECT_EQ(r.served[0], r.fetched[0]);
#endif
}

TEST(NcclGpuLink, EachGpuAProcessReadingTheOthersSources) {
#ifndef SHARDMERGE_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL (needs the CUDA toolkit's nccl.h)";
#else
  const int gpus = gpus_usable();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs (one per process), this machine has " << gpus;
  testing::WorldOptions o;
  o.size = std::min(gpus, 4);
  o.idle = {o.size - 1};
  o.failing_file = static_cast<uint32_t>(o.size);  // owned by rank 0
  const auto r = run_on_gpus(o);
  EXPECT_EQ(r.wrong_bytes, 0u);
  for (const std::string& f : r.failures) EXPECT_NE(f.find("process rank 0, which holds this source"), std::string::npos) << f;
  uint64_t served = 0, fetched = 0;
  for (int rank = 0; rank < o.size; ++rank) served += r.served[static_cast<size_t>(rank)], fetched += r.fetched[static_cast<size_t>(rank)];
  EXPECT_GT(fetched, 0u);
  EXPECT_EQ(served, fetched);
#endif
}

}  // namespace
}  // namespace shardmerge
