// Strided N-d box copy with cast: block row y copies region y of a staged fill into the
// destination box, each thread taking every (gridDim.x * blockDim.x)-th element of the region.
// One launch per fill, whatever mix of pieces and dtypes the fill holds.
#include <algorithm>
#include <string>

#include "kernels/cuda_check.hpp"
#include "kernels/gather_box.cuh"
#include "kernels/grid.cuh"
#include "kernels/kernels.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::kernels {
namespace {

__global__ void gather_box_kernel(const RegionCopy* regions, const uint8_t* staged, uint8_t* dst, DType to) {
  const RegionCopy& region = regions[blockIdx.y];
  visit_cast(region.from, to, [&](auto op) {
    using Op = decltype(op);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t j = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < region.numel; j += stride)
      copy_element<Op>(region, j, staged, dst);
  });
}

}  // namespace

void launch_gather_box(const RegionCopy* regions, uint32_t count, uint64_t max_numel, const uint8_t* staged, void* dst,
                       DType to, cudaStream_t stream) {
  if (count == 0) return;
  if (count > kMaxRegionsPerLaunch)
    throw Error("internal: " + std::to_string(count) + " regions in one gather launch (at most " +
                std::to_string(kMaxRegionsPerLaunch) + ")");
  // Blocks per region: what the largest region needs, within about a million blocks in all.
  const unsigned per_region = std::min(grid_blocks(max_numel), std::max(1u, (1u << 20) / count));
  gather_box_kernel<<<dim3(per_region, count), kBlockThreads, 0, stream>>>(regions, staged, static_cast<uint8_t*>(dst),
                                                                            to);
  cuda::check_launch("gather_box");
}

}  // namespace shardmerge::kernels
