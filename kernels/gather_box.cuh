// The index math of the gather kernel: a region of a source, staged on the device as the span of
// its file that covers it, is copied (and cast) into a row-major destination box. Thread j takes
// the region's row-major element j, turns it into a multi-index and that into a source and a
// destination offset. TP/FSDP concatenation along any dim, transposed sources, QKV
// de-interleaving and gate/up splits are all such regions: the planner expresses them as
// Slices. Plain C++ too (SM_HD): tests/unit/test_kernel_math.cpp runs this exact code on the
// CPU against gather.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cast.cuh"
#include "shardmerge/error.hpp"

namespace shardmerge::kernels {

// Dims a region may have after coalescing (tensors have at most 5 in practice).
constexpr int kMaxBoxDims = 8;

// Element (i_0 .. i_{n-1}) of the box is at sum(i_k * src_strides[k]) elements into the source
// and sum(i_k * dst_strides[k]) elements into the destination.
struct BoxMap {
  int32_t ndim = 0;
  int64_t extent[kMaxBoxDims] = {};
  int64_t src_strides[kMaxBoxDims] = {};
  int64_t dst_strides[kMaxBoxDims] = {};
};

struct ElementOffsets {
  int64_t src = 0;
  int64_t dst = 0;
};

// Offsets of the box's row-major element `linear`.
SM_HD ElementOffsets box_offsets(const BoxMap& m, uint64_t linear) {
  ElementOffsets o;
  for (int d = m.ndim - 1; d >= 0; --d) {
    const auto e = static_cast<uint64_t>(m.extent[d]);
    const auto i = static_cast<int64_t>(linear % e);
    linear /= e;
    o.src += i * m.src_strides[d];
    o.dst += i * m.dst_strides[d];
  }
  return o;
}

// The map of an `ndim`-dim box with fewer dims, so each element costs fewer divisions: dims of
// extent 1 are dropped, and a dim merges into the next inner one where both sides step over it
// as one run. Throws when more than kMaxBoxDims remain.
inline BoxMap coalesce(const int64_t* extent, const int64_t* src_strides, const int64_t* dst_strides, size_t ndim) {
  BoxMap out;
  for (size_t d = 0; d < ndim; ++d) {
    if (extent[d] == 1) continue;
    const int last = out.ndim - 1;
    if (last >= 0 && out.src_strides[last] == src_strides[d] * extent[d] &&
        out.dst_strides[last] == dst_strides[d] * extent[d]) {
      out.extent[last] *= extent[d];
      out.src_strides[last] = src_strides[d];
      out.dst_strides[last] = dst_strides[d];
      continue;
    }
    if (out.ndim == kMaxBoxDims)
      throw Error("a gather region has more than " + std::to_string(kMaxBoxDims) + " dims that cannot be merged");
    out.extent[out.ndim] = extent[d];
    out.src_strides[out.ndim] = src_strides[d];
    out.dst_strides[out.ndim] = dst_strides[d];
    ++out.ndim;
  }
  return out;
}

// Regions one gather launch takes: they are its grid's y dimension, and their descriptors travel
// with the staged bytes.
constexpr uint32_t kMaxRegionsPerLaunch = 1024;

// One region of a staged fill, as the kernel reads it from device memory.
struct RegionCopy {
  BoxMap map;
  uint64_t src_offset = 0;  // bytes into the fill's staged data (a multiple of 16)
  int64_t dst_offset = 0;   // elements into the destination box
  uint64_t numel = 0;
  DType from = DType::F32;
};

// Host: the descriptor of an `ndim`-dim region (source `strides` in elements of `from`) staged at
// `src_offset`, landing at element `dst_offset` of a destination with `dst_strides`.
inline RegionCopy describe_region(DType from, const int64_t* extent, const int64_t* src_strides,
                                  const int64_t* dst_strides, size_t ndim, uint64_t src_offset, int64_t dst_offset) {
  RegionCopy r;
  r.from = from;
  r.src_offset = src_offset;
  r.dst_offset = dst_offset;
  r.numel = 1;
  for (size_t d = 0; d < ndim; ++d) r.numel *= static_cast<uint64_t>(extent[d]);
  r.map = coalesce(extent, src_strides, dst_strides, ndim);
  return r;
}

// What kernel thread work item j of region `r` does: one element from the staged fill to `dst`.
template <class Op>
SM_HD void copy_element(const RegionCopy& r, uint64_t j, const uint8_t* staged, uint8_t* dst) {
  const ElementOffsets o = box_offsets(r.map, j);
  const auto* in = reinterpret_cast<const typename Op::In*>(staged + r.src_offset);
  auto* out = reinterpret_cast<typename Op::Out*>(dst);
  out[r.dst_offset + o.dst] = Op::apply(in[o.src]);
}

}  // namespace shardmerge::kernels
