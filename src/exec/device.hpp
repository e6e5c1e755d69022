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

// `gpu_memory`: device memory per GPU (0: the CUDA executor's default).
ChosenExecutor choose_executor(const DeviceRequest& request, uint64_t gpu_memory);

}  // namespace shardmerge
