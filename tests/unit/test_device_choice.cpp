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
  const Workload copies{uint64_t{10} << 30, 0, 16};
  EXPECT_EQ(choose_executor(parse_device("cpu"), 0, copies).executor->name(), "cpu");
  const ChosenExecutor automatic = choose_executor(parse_device("auto"), 0, copies);
  // 16 cores out-copy one GPU (as measured on an H200 node): auto stays on the CPU either way.
  EXPECT_EQ(automatic.executor->name(), "cpu");
  EXPECT_EQ(automatic.description.rfind("cpu (--device auto: ", 0), 0u) << automatic.description;
  if (usable_cuda_device()) {
    const ChosenExecutor few_cores = choose_executor(parse_device("auto"), 0, Workload{uint64_t{10} << 30, 0, 1});
    EXPECT_EQ(few_cores.description.rfind("cuda:0", 0), 0u) << few_cores.description;
    return;
  }
  try {
    choose_executor(parse_device("cuda:0"), 0, copies);
    FAIL() << "--device cuda without a usable GPU must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
    EXPECT_NE(std::string(e.what()).find("--device cuda: "), std::string::npos) << e.what();
  }
}

// The fewest cores at which auto keeps a workload on the CPU.
unsigned cpu_from(uint64_t bytes, uint64_t fold_bytes) {
  for (unsigned cores = 1; cores <= 256; ++cores)
    if (!predict_auto(Workload{bytes, fold_bytes, cores}).gpu) return cores;
  return 0;
}

TEST(DeviceOption, AutoTakesTheGpuOnlyWhereItIsPredictedFaster) {
  const uint64_t gb = uint64_t{1} << 30;
  for (uint64_t fold : {uint64_t{0}, 5 * gb, 10 * gb}) {
    const unsigned crossover = cpu_from(10 * gb, fold);
    ASSERT_GT(crossover, 1u) << "one core must lose to a GPU";
    for (unsigned cores = 1; cores <= 64; ++cores) {
      const AutoPrediction p = predict_auto(Workload{10 * gb, fold, cores});
      EXPECT_EQ(p.gpu, cores < crossover) << cores << " cores, fold bytes " << fold;  // one crossover
      EXPECT_EQ(p.gpu, p.gpu_seconds * 1.25 < p.cpu_seconds);                         // by a clear margin
      // The choice depends on the mix, not the size; the predicted times scale with it.
      const AutoPrediction tenth = predict_auto(Workload{gb, fold / 10, cores});
      EXPECT_EQ(tenth.gpu, p.gpu);
      EXPECT_NEAR(tenth.cpu_seconds * 10, p.cpu_seconds, 1e-9 * p.cpu_seconds);
    }
    // The H200 node the rates come from (16 cores) was faster on the CPU, with and without folds.
    EXPECT_LE(crossover, 16u);
  }
  // Folds cost the CPU more per byte than casts, so they pay on the GPU up to more cores.
  EXPECT_GT(cpu_from(10 * gb, 10 * gb), cpu_from(10 * gb, 0));
  // An unknown plan (multi-process merges) is weighed as plain casts.
  EXPECT_EQ(predict_auto(Workload{0, 0, 2}).gpu, predict_auto(Workload{10 * gb, 0, 2}).gpu);
}

TEST(DeviceOption, TheCliSaysWhichExecutorRan) {
  const auto r = test::run_shardmerge("merge --local_dir /nonexistent --device gpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--device gpu: expected cpu, cuda, cuda:0,1,... or auto"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace shardmerge
