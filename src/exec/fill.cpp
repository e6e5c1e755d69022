#include "exec/fill.hpp"

#include <algorithm>
#include <string>

#include "exec/convert_cpu.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {

Fill pack_fill(const std::vector<GatherRegion>& regions, size_t& next, uint64_t capacity,
               const std::vector<int64_t>& dst_strides, DType to) {
  Fill fill;
  for (; next < regions.size() && fill.regions.size() < kernels::kMaxRegionsPerLaunch; ++next) {
    const GatherRegion& g = regions[next];
    const uint64_t at = (fill.bytes + 15) / 16 * 16, span = g.span_bytes();
    if (!fill.regions.empty() && at + span > capacity) break;
    if (!can_convert(g.dtype, to))
      throw Error("cannot convert " + std::string(dtype_name(g.dtype)) + " to " + std::string(dtype_name(to)));
    fill.regions.push_back(kernels::describe_region(g.dtype, g.extent.data(), g.strides.data(), dst_strides.data(),
                                                    g.extent.size(), at, g.dst_index));
    fill.reads.push_back({g.file, g.offset, at, span});
    fill.bytes = at + span;
    fill.max_numel = std::max(fill.max_numel, g.numel());
    fill.source_bytes += g.numel() * dtype_size(g.dtype);
  }
  return fill;
}

}  // namespace shardmerge
