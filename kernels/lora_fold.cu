// The LoRA fold on the GPU: cuBLAS accumulates scale * B·A into the fp32 W slab (beta = 1), in
// the same orientation as the CPU executor's cblas_sgemm, then one kernel checks every value is
// finite and casts the slab to the output dtype.
#include <climits>
#include <string>

#include "kernels/cast.cuh"
#include "kernels/cublas_api.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/grid.cuh"
#include "kernels/kernels.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::kernels {
namespace {

int gemm_dim(int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX) throw Error("LoRA fold: " + std::string(what) + " " + std::to_string(n) + " is too large for cuBLAS");
  return static_cast<int>(n);
}

template <class Op>
__global__ void finite_cast_kernel(const uint32_t* w, uint64_t n, typename Op::Out* dst,
                                   unsigned long long* first_nonfinite) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t bits = w[i];
    if ((bits & 0x7F800000u) == 0x7F800000u) atomicMin(first_nonfinite, static_cast<unsigned long long>(i));
    dst[i] = Op::apply(bits);
  }
}

template <class Op>
void launch_finite(const float* w, uint64_t n, void* dst, unsigned long long* first_nonfinite, cudaStream_t stream) {
  finite_cast_kernel<Op><<<grid_blocks(n), kBlockThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(w), n, static_cast<typename Op::Out*>(dst), first_nonfinite);
}

}  // namespace

void lora_accumulate(cublasHandle_t handle, const LoraProduct& p) {
  // cuBLAS is column-major: the row-major W [rows, cols] is W^T [cols, rows] to it, so each
  // product is computed transposed, operands swapped.
  const int m = gemm_dim(p.cols, "column count"), n = gemm_dim(p.rows, "row count"), k = gemm_dim(p.rank, "rank");
  const float beta = 1.0f;
  if (!p.fan_in_fan_out) {
    // W^T [cols, rows] += scale * A^T [cols, rank] @ B_rows^T [rank, rows]
    cuda::check(cuda::cublas().sgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &p.scale, p.resident, m, p.part, k, &beta, p.w, m),
                "cublasSgemm (LoRA fold)");
  } else {
    // W^T [cols, rows] += scale * B [cols, rank] @ A_cols [rank, rows]
    cuda::check(cuda::cublas().sgemm(handle, CUBLAS_OP_T, CUBLAS_OP_T, m, n, k, &p.scale, p.resident, k, p.part, n, &beta, p.w, m),
                "cublasSgemm (LoRA fold, fan_in_fan_out)");
  }
}

void launch_finite_cast(const float* w, uint64_t n, void* dst, DType to, unsigned long long* first_nonfinite,
                        cudaStream_t stream) {
  if (n == 0) return;
  switch (to) {
    case DType::F32: launch_finite<Copy<4>>(w, n, dst, first_nonfinite, stream); break;
    case DType::BF16: launch_finite<Cast<DType::F32, DType::BF16>>(w, n, dst, first_nonfinite, stream); break;
    case DType::F16: launch_finite<Cast<DType::F32, DType::F16>>(w, n, dst, first_nonfinite, stream); break;
    case DType::F64: launch_finite<Cast<DType::F32, DType::F64>>(w, n, dst, first_nonfinite, stream); break;
    default: throw Error("cannot convert float32 to " + std::string(dtype_name(to)));
  }
  cuda::check_launch("finite_cast");
}

}  // namespace shardmerge::kernels
