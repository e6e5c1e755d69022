// The CUDA executor's host --memory-limit check before any context exists (host-only, so it
// runs without a GPU): the contexts and, with LoRA folds, cuBLAS count against the limit.
#include <gtest/gtest.h>

#include <string>

#include "exec/cuda/host_memory.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::cuda {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

std::string refusal(uint64_t limit, uint64_t devices, bool folds) {
  try {
    require_host_memory_for_cuda(limit, 30 * kMiB, 64 * kMiB, 1 * kMiB, devices, folds);
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
    return e.what();
  }
  return "";
}

TEST(CudaHostMemory, ContextsAndCublasCountAgainstTheLimit) {
  // 30 MiB resident + 64 MiB reserve + 1 MiB staging fit 512 MiB; with a 256 MiB context too,
  // but not with cuBLAS's 224 MiB on top, nor with two contexts and cuBLAS in 768 MiB.
  EXPECT_EQ(refusal(512 * kMiB, 1, false), "");
  const std::string folds = refusal(512 * kMiB, 1, true);
  EXPECT_NE(folds.find("CUDA context"), std::string::npos) << folds;
  EXPECT_NE(folds.find("cuBLAS"), std::string::npos) << folds;
  EXPECT_NE(folds.find("estimate"), std::string::npos) << folds;
  EXPECT_NE(folds.find("575 MiB"), std::string::npos) << folds;  // 30 + 64 + 256 + 224 + 1
  EXPECT_EQ(refusal(575 * kMiB, 1, true), "");
  EXPECT_NE(refusal(768 * kMiB, 2, true).find("CUDA contexts"), std::string::npos);
  EXPECT_EQ(expected_cuda_host_bytes(2, true), 2 * kContextHostBytes + kCublasHostBytes);
}

}  // namespace
}  // namespace shardmerge::cuda
