// Gathers a box of a tensor, tiled by strided source Slices, into a dense row-major buffer of
// any (convertible) dtype, reading through one bounded staging buffer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/tasks.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge {

struct SourceFds {
  std::vector<int> fds;
  std::vector<std::string> names;
};

class Gatherer {
 public:
  Gatherer(const SourceFds& sources, uint8_t* staging, size_t staging_size)
      : sources_(sources), staging_(staging), staging_size_(staging_size) {}

  // Fills `dst` (row-major over box.extent, elements of `to`) from the pieces that intersect
  // the box; the pieces must tile it. Returns the number of source bytes read.
  uint64_t gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to);

 private:
  struct Region {  // a sub-box of one piece, and where it lands in dst
    uint32_t file;
    uint64_t offset;
    DType dtype;
    std::vector<int64_t> strides, extent, dst_strides;
    uint8_t* dst;
  };
  uint64_t copy_region(const Region& r, DType to);

  const SourceFds& sources_;
  uint8_t* staging_;
  size_t staging_size_;
};

}  // namespace shardmerge
