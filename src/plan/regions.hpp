// New tensors made of boxes of others: un-stacking a layer axis, splitting fused QKV or
// gate/up projections, concatenating tensor-parallel shards, trimming padded vocab rows. All
// of it is Slice arithmetic on descriptions; no bytes move until an executor runs the plan.
#pragma once

#include <string>
#include <vector>

#include "geometry/source_set.hpp"

namespace shardmerge {

// The box [start, start + extent) of `src`, placed at `dst_start` of the new tensor. The first
// `drop` dims of the box must have extent 1 and do not exist in the new tensor.
struct Region {
  const SourceTensor* src = nullptr;
  std::vector<int64_t> start;
  std::vector<int64_t> extent;
  std::vector<int64_t> dst_start;
  size_t drop = 0;
};

// The whole of `src` at `dst_start` (concatenation).
Region whole(const SourceTensor& src, std::vector<int64_t> dst_start);

// Builds a tensor from regions; throws an Error naming it unless they tile `shape` exactly once.
SourceTensor assemble(std::string name, DType dtype, std::vector<int64_t> shape, const std::vector<Region>& regions,
                      std::string origin);

}  // namespace shardmerge
