#include "exec/gather.hpp"

#include "exec/convert_cpu.hpp"
#include "exec/io.hpp"

namespace shardmerge {

uint64_t Gatherer::gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to) {
  const size_t ndim = box.extent.size();
  std::vector<int64_t> dst_strides(ndim, 1);
  for (size_t d = ndim; d-- > 1;) dst_strides[d - 1] = dst_strides[d] * box.extent[d];
  uint64_t read = 0;
  for (const Slice& piece : pieces) {
    auto sub = intersect(piece, box.start, box.extent);
    if (!sub || sub->numel() == 0) continue;
    int64_t at = 0;
    for (size_t d = 0; d < ndim; ++d) at += (sub->start[d] - box.start[d]) * dst_strides[d];
    Region r{sub->file, sub->offset, sub->dtype, sub->strides, sub->extent, dst_strides,
             static_cast<uint8_t*>(dst) + static_cast<size_t>(at) * dtype_size(to)};
    read += copy_region(r, to);
  }
  return read;
}

// Reads the byte span that covers the region in one pread when it fits the staging buffer;
// otherwise halves the region along its outermost non-trivial dim (a transposed or very
// strided source ends up read row by row, or element by element, but never past the budget).
uint64_t Gatherer::copy_region(const Region& r, DType to) {
  const uint64_t elem = dtype_size(r.dtype);
  uint64_t span = 1;
  for (size_t d = 0; d < r.extent.size(); ++d) span += static_cast<uint64_t>((r.extent[d] - 1) * r.strides[d]);
  if (span * elem <= staging_size_) {
    pread_exact(sources_.fds[r.file], r.offset, staging_, span * elem, sources_.names[r.file]);
    convert_box(staging_, r.dtype, r.strides.data(), r.dst, to, r.dst_strides.data(), r.extent.data(), r.extent.size());
    uint64_t bytes = elem;
    for (int64_t e : r.extent) bytes *= static_cast<uint64_t>(e);
    return bytes;
  }
  size_t d = 0;
  while (d < r.extent.size() && r.extent[d] == 1) ++d;
  // d < ndim here: a single element always fits the staging buffer.
  const int64_t half = r.extent[d] / 2;
  Region lo = r, hi = r;
  lo.extent[d] = half;
  hi.extent[d] = r.extent[d] - half;
  hi.offset += static_cast<uint64_t>(half * r.strides[d]) * elem;
  hi.dst += static_cast<size_t>(half * r.dst_strides[d]) * dtype_size(to);
  return copy_region(lo, to) + copy_region(hi, to);
}

}  // namespace shardmerge
