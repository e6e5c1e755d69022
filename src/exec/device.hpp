// Which executor runs a plan: `--device cpu | cuda | cuda:0,1,... | auto`. Builds without CUDA
// know the spellings too, so that `--device cuda` there says why it cannot be, and `auto` runs
// on the CPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardmerge/executor.hpp"

namespace shardmerge {

struct DeviceRequest {
  enum class Kind { Cpu, Cuda, Auto } kind = Kind::Cpu;
  std::vector<int> devices;  // for Cuda: the ordinals named, empty for all
};

// Throws a usage error for anything else than the spellings above.
DeviceRequest parse_device(const std::string& text);

struct ChosenExecutor {
  std::unique_ptr<Executor> executor;
  std::string description;  // which one runs, and for `auto` on the CPU, why
};

// What `--device auto` weighs: the bytes a plan moves (read + written), the share of them in
// tensors with a LoRA fold, and the CPU executor's threads (--threads; 0: one per core). Bytes
// are 0 where the plan is made later (multi-process merges): then only the cores count.
struct Workload {
  uint64_t bytes = 0;
  uint64_t fold_bytes = 0;
  unsigned cores = 0;
};
Workload workload_of(const MergePlan& plan, unsigned threads);

// The rule behind `--device auto`, with the rates measured by bench/gpu_check.sh (device.cpp
// has them): predicted seconds on the CPU and on one GPU; the GPU is chosen only when it is
// predicted to be at least 25% faster.
struct AutoPrediction {
  double cpu_seconds = 0, gpu_seconds = 0;
  bool gpu = false;
};
AutoPrediction predict_auto(const Workload& w);

// `gpu_memory`: device memory per GPU (0: the CUDA executor's default).
ChosenExecutor choose_executor(const DeviceRequest& request, uint64_t gpu_memory, const Workload& workload);

}  // namespace shardmerge
