// Launch shapes shared by the kernels: grid-stride loops over 256-thread blocks.
#pragma once

#include <algorithm>
#include <cstdint>

namespace shardmerge::kernels {

constexpr unsigned kBlockThreads = 256;

// Blocks for a grid-stride loop over n items: enough to fill the largest GPU several times over,
// and never more than the items need.
inline unsigned grid_blocks(uint64_t n) {
  const uint64_t needed = (n + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(std::clamp<uint64_t>(needed, 1, 16384));
}

}  // namespace shardmerge::kernels
