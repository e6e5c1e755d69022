// `--device`: its spellings, and which executor each gives in this build on this machine. Runs
// in every build: without CUDA, `cuda` must say why it cannot be and `auto` must run on the CPU.
#include <gtest/gtest.h>

#include "exec/device.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

#ifdef SHARDMERGE_HAVE_CUDA
#include "exec/cuda/cuda_executor.hpp"
#endif

namespace shardmerge {
namespace {

bool usable_cuda_device() {
#ifdef SHARDMERGE_HAVE_CUDA
  return probe_cuda_devices().count > 0;
#else
  return false;
#endif
}

TEST(DeviceOption, Spellings) {
  EXPECT_EQ(parse_device("cpu").kind, DeviceRequest::Kind::Cpu);
  EXPECT_EQ(parse_device("auto").kind, DeviceRequest::Kind::Auto);
  const DeviceRequest all = parse_device("cuda");
  EXPECT_EQ(all.kind, DeviceRequest::Kind::Cuda);
  EXPECT_TRUE(all.devices.empty());
  EXPECT_EQ(parse_device("cuda:3").devices, std::vector<int>({3}));
  EXPECT_EQ(parse_device("cuda:0,2,1").devices, std::vector<int>({0, 2, 1}));
  for (const char* bad : {"gpu", "CUDA", "cuda:", "cuda:a", "cuda:0,", "cuda:,1", "cuda:-1", "cuda:0;1", "cuda0", ""}) {
    try {
      parse_device(bad);
      FAIL() << "'" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), ExitCode::usage) << bad;
    }
  }
}

TEST(DeviceOption, CpuAlwaysAutoSaysWhichCudaExplainsItsAbsence) {
  EXPECT_EQ(choose_executor(parse_device("cpu"), 0).executor->name(), "cpu");
  const ChosenExecutor automatic = choose_executor(parse_device("auto"), 0);
  if (usable_cuda_device()) {
    EXPECT_EQ(automatic.description.rfind("cuda:0", 0), 0u) << automatic.description;
    return;
  }
  EXPECT_EQ(automatic.executor->name(), "cpu");
  EXPECT_EQ(automatic.description.rfind("cpu (--device auto: ", 0), 0u) << automatic.description;
  try {
    choose_executor(parse_device("cuda:0"), 0);
    FAIL() << "--device cuda without a usable GPU must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
    EXPECT_NE(std::string(e.what()).find("--device cuda: "), std::string::npos) << e.what();
  }
}

TEST(DeviceOption, TheCliSaysWhichExecutorRan) {
  const auto r = test::run_shardmerge("merge --local_dir /nonexistent --device gpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--device gpu: expected cpu, cuda, cuda:0,1,... or auto"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace shardmerge
