// How the CUDA executor stages gather regions: packed back to back (16-byte aligned) into fills
// of a bounded buffer, each region with the descriptor the gather kernel reads. Pure arithmetic,
// built in every configuration, so that CPU tests run the kernel's per-element code over real
// fills (tests/unit/test_kernel_math.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "exec/gather.hpp"
#include "kernels/gather_box.cuh"

namespace shardmerge {

// Bytes of a source file to read to `offset` of the fill's data.
struct FillRead {
  uint32_t file = 0;
  uint64_t file_offset = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct Fill {
  std::vector<kernels::RegionCopy> regions;
  std::vector<FillRead> reads;
  uint64_t bytes = 0;         // data bytes used
  uint64_t max_numel = 0;     // of the largest region
  uint64_t source_bytes = 0;  // element bytes of the regions (what an executor counts as read)
};

// Packs regions from `next` on into one fill of at most `capacity` data bytes and
// kMaxRegionsPerLaunch regions (at least one region: gather_regions bounds each span by the
// capacity), destined for a box with
// `dst_strides` of dtype `to`; advances `next`. Throws for a dtype pair with no conversion.
Fill pack_fill(const std::vector<GatherRegion>& regions, size_t& next, uint64_t capacity,
               const std::vector<int64_t>& dst_strides, DType to);

}  // namespace shardmerge
