#include "kernels/cuda_check.hpp"

#include "kernels/cublas_api.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::cuda {
namespace {

std::string current_device() {
  int device = -1;
  return cudaGetDevice(&device) == cudaSuccess ? " on cuda:" + std::to_string(device) : std::string();
}

}  // namespace

void check(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return;
  throw Error("CUDA: " + what + current_device() + " failed: " + cudaGetErrorName(status) + " (" +
              cudaGetErrorString(status) + ")");
}

void check(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Error("cuBLAS: " + what + current_device() + " failed: " + cublas().status_name(status) + " (" +
              cublas().status_string(status) + ")");
}

void check_launch(const char* kernel) { check(cudaGetLastError(), std::string("launching kernel ") + kernel); }

}  // namespace shardmerge::cuda
