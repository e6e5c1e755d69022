// Contiguous dtype conversion (Run tasks): one element per thread and step, through the same
// Cast operations as every other kernel.
#include <string>

#include "kernels/cast.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/grid.cuh"
#include "kernels/kernels.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::kernels {
namespace {

template <class Op>
__global__ void cast_kernel(const typename Op::In* src, typename Op::Out* dst, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = Op::apply(src[i]);
}

}  // namespace

void launch_cast(const void* src, DType from, void* dst, DType to, uint64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool known = visit_cast(from, to, [&](auto op) {
    using Op = decltype(op);
    cast_kernel<Op><<<grid_blocks(n), kBlockThreads, 0, stream>>>(static_cast<const typename Op::In*>(src),
                                                                   static_cast<typename Op::Out*>(dst), n);
  });
  if (!known) throw Error("cannot convert " + std::string(dtype_name(from)) + " to " + std::string(dtype_name(to)));
  cuda::check_launch("cast");
}

}  // namespace shardmerge::kernels
