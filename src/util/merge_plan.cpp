// The code of the plan's types (include/shardmerge/plan.hpp): on the ground floor with util/,
// since every layer above, executors included, uses them.
#include <algorithm>

#include "shardmerge/plan.hpp"
#include "util/shape.hpp"

namespace shardmerge {

uint64_t Slice::numel() const { return element_count(extent); }

bool Slice::source_contiguous() const {
  int64_t expected = 1;
  for (size_t i = extent.size(); i-- > 0;) {
    if (extent[i] != 1 && strides[i] != expected) return false;
    expected *= extent[i];
  }
  return true;
}

std::optional<Slice> intersect(const Slice& s, const std::vector<int64_t>& start, const std::vector<int64_t>& extent) {
  Slice out = s;
  const uint64_t elem = dtype_size(s.dtype);
  for (size_t d = 0; d < s.start.size(); ++d) {
    const int64_t lo = std::max(s.start[d], start[d]);
    const int64_t hi = std::min(s.start[d] + s.extent[d], start[d] + extent[d]);
    if (lo >= hi) return std::nullopt;
    out.offset += static_cast<uint64_t>((lo - s.start[d]) * s.strides[d]) * elem;
    out.start[d] = lo;
    out.extent[d] = hi - lo;
  }
  return out;
}

uint64_t OutputTensor::numel() const { return element_count(shape); }

uint64_t MergePlan::bytes_read() const {
  uint64_t n = 0;
  auto add = [&](const std::vector<Slice>& slices) {
    for (const auto& s : slices) n += s.numel() * dtype_size(s.dtype);
  };
  for (const auto& t : tensors) {
    add(t.copies);
    if (t.lora) {
      add(t.lora->a);
      add(t.lora->b);
    }
  }
  return n;
}

uint64_t MergePlan::bytes_written() const {
  uint64_t n = 0;
  for (const auto& f : files) n += f.size;
  return n;
}

}  // namespace shardmerge
