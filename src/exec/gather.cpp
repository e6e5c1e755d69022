#include "exec/gather.hpp"

#include "exec/convert_cpu.hpp"
#include "util/shape.hpp"

namespace shardmerge {
namespace {

void split_to_fit(GatherRegion r, uint64_t max_span_bytes, const std::vector<int64_t>& dst_strides,
                  std::vector<GatherRegion>& out) {
  if (r.span_bytes() <= max_span_bytes) {
    out.push_back(std::move(r));
    return;
  }
  size_t d = 0;
  while (d < r.extent.size() && r.extent[d] == 1) ++d;
  // d < ndim here: a single element always fits.
  const int64_t half = r.extent[d] / 2;
  GatherRegion hi = r;
  r.extent[d] = half;
  hi.extent[d] -= half;
  hi.offset += static_cast<uint64_t>(half * r.strides[d]) * dtype_size(r.dtype);
  hi.dst_index += half * dst_strides[d];
  split_to_fit(std::move(r), max_span_bytes, dst_strides, out);
  split_to_fit(std::move(hi), max_span_bytes, dst_strides, out);
}

// True when the region is one dense run both in its file and in the destination box, so it
// can be read straight into place instead of through the staging buffer.
bool is_dense_run(const GatherRegion& r, const std::vector<int64_t>& dst_strides) {
  int64_t run = 1;
  for (size_t d = r.extent.size(); d-- > 0;) {
    if (r.extent[d] == 1) continue;
    if (r.strides[d] != run || dst_strides[d] != run) return false;
    run *= r.extent[d];
  }
  return true;
}

}  // namespace

uint64_t GatherRegion::numel() const { return element_count(extent); }

uint64_t GatherRegion::span_bytes() const {
  uint64_t span = 1;
  for (size_t d = 0; d < extent.size(); ++d) span += static_cast<uint64_t>((extent[d] - 1) * strides[d]);
  return span * dtype_size(dtype);
}

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& extent) {
  std::vector<int64_t> strides(extent.size(), 1);
  for (size_t d = extent.size(); d-- > 1;) strides[d - 1] = strides[d] * extent[d];
  return strides;
}

std::vector<GatherRegion> gather_regions(const std::vector<Slice>& pieces, const Box& box, uint64_t max_span_bytes) {
  std::vector<int64_t> dst_strides = row_major_strides(box.extent);
  std::vector<GatherRegion> out;
  for (const Slice& piece : pieces) {
    auto sub = intersect(piece, box.start, box.extent);
    if (!sub || sub->numel() == 0) continue;
    int64_t at = 0;
    for (size_t d = 0; d < box.extent.size(); ++d) at += (sub->start[d] - box.start[d]) * dst_strides[d];
    split_to_fit(GatherRegion{sub->file, sub->offset, sub->dtype, sub->strides, sub->extent, at}, max_span_bytes,
                 dst_strides, out);
  }
  return out;
}

uint64_t Gatherer::gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to) {
  const std::vector<int64_t> dst_strides = row_major_strides(box.extent);
  uint64_t read = 0;
  for (const GatherRegion& r : gather_regions(pieces, box, staging_size_)) {
    uint8_t* at = static_cast<uint8_t*>(dst) + r.dst_index * dtype_size(to);
    if (r.dtype == to && is_dense_run(r, dst_strides)) {
      sources_.read(r.file, r.offset, at, r.span_bytes());
    } else {
      sources_.read(r.file, r.offset, staging_, r.span_bytes());
      convert_box(staging_, r.dtype, r.strides.data(), at, to, dst_strides.data(), r.extent.data(), r.extent.size());
    }
    read += r.numel() * dtype_size(r.dtype);
  }
  return read;
}

}  // namespace shardmerge
