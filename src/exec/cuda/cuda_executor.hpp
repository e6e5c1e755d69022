// The CUDA executor: the CPU executor's tasks (exec/tasks.hpp), run on one or more GPUs of this
// machine. Tasks are split across the devices by bytes, one host thread and three streams per
// device (exec/cuda/device_runner.hpp). Conversions and gathers are byte-identical to the CPU
// executor; LoRA folds agree with it to within rounding of the fp32 products (an output ulp).
// A multi-process merge gives each process its share of the plan and its local device(s).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardmerge/executor.hpp"

namespace shardmerge {

// How many CUDA devices this process can use, and why none when there are none (no driver, no
// device, a driver older than the runtime).
struct CudaDevices {
  int count = 0;
  std::string unavailable;
};
CudaDevices probe_cuda_devices();

// `devices`: ordinals to use (empty: all). `gpu_memory`: device memory each may use (0: the
// smaller of 4 GiB and 80% of what is free). Throws a usage error for a device that is not there.
std::unique_ptr<Executor> make_cuda_executor(std::vector<int> devices, uint64_t gpu_memory);

}  // namespace shardmerge
