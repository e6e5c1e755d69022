// Every CUDA runtime and cuBLAS call goes through these: a failure becomes a shardmerge::Error
// naming the call and the device, never an abort.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

namespace shardmerge::cuda {

void check(cudaError_t status, const std::string& what);
void check(cublasStatus_t status, const std::string& what);
// After a kernel launch: the launch error, if any (an invalid configuration, no kernel image for
// this GPU's architecture).
void check_launch(const char* kernel);

}  // namespace shardmerge::cuda
