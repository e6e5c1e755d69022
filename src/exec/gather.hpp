// Gathers a box of a tensor, tiled by strided source Slices, into a dense row-major buffer of
// any (convertible) dtype, reading through one bounded staging buffer. The cutting of a box into
// file spans (gather_regions) is shared with the CUDA executor, which ships the spans to the GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/sources.hpp"
#include "exec/tasks.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge {

// A sub-box of one piece whose elements lie within one span of its file, and where the sub-box
// lands in the destination box.
struct GatherRegion {
  uint32_t file = 0;
  uint64_t offset = 0;  // byte offset of the first element (and of the span)
  DType dtype = DType::F32;
  std::vector<int64_t> strides, extent;  // in the source, in elements
  int64_t dst_index = 0;                 // row-major element index of its first element in the box
  uint64_t numel() const;
  uint64_t span_bytes() const;  // from the first element to the last, inclusive
};

// Row-major strides (in elements) of a dense array of `extent`.
std::vector<int64_t> row_major_strides(const std::vector<int64_t>& extent);

// The regions that fill `box` from the pieces that intersect it, in piece order, each halved
// along its outermost non-trivial dim until its span is at most `max_span_bytes` (a transposed
// or very strided source ends up read row by row, or element by element, but never past it).
std::vector<GatherRegion> gather_regions(const std::vector<Slice>& pieces, const Box& box, uint64_t max_span_bytes);

class Gatherer {
 public:
  Gatherer(const SourceFds& sources, uint8_t* staging, size_t staging_size)
      : sources_(sources), staging_(staging), staging_size_(staging_size) {}

  // Fills `dst` (row-major over box.extent, elements of `to`) from the pieces that intersect
  // the box; the pieces must tile it. Returns the number of source bytes read.
  uint64_t gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to);

 private:
  const SourceFds& sources_;
  uint8_t* staging_;
  size_t staging_size_;
};

}  // namespace shardmerge
