// Sharding arithmetic as pure functions: torch.chunk splits, DTensor placements to the global
// index ranges a rank holds, strided views to Slices, and the check that a set of Slices tiles
// a tensor exactly once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/torch_pt.hpp"
#include "shardmerge/plan.hpp"
#include "util/shape.hpp"

namespace shardmerge {

struct Interval {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
// A sequence of global indices along one dim, as ordered runs.
using Runs = std::vector<Interval>;

int64_t runs_length(const Runs& runs);

// Piece k of n of the sequence, with torch.chunk semantics: pieces of ceil(L/n), the last
// ones short or empty.
Runs chunk_runs(const Runs& runs, int64_t n, int64_t k);

// For each tensor dim, the global indices that a rank at `coordinate` holds. The mesh dims
// that shard a tensor dim apply left to right, or in the order `shard_order` gives (Shard:
// chunk; _StridedShard: split into split_factor pieces, chunk each, concatenate). Replicate
// changes nothing; Partial is refused.
std::vector<Runs> dtensor_local_runs(const std::vector<int64_t>& global_shape, const std::vector<Placement>& placements,
                                     const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coordinate,
                                     const std::vector<std::pair<int64_t, std::vector<int64_t>>>& shard_order = {});

// Splits a local strided view whose dim d covers runs[d] of the global tensor into Slices
// (one per combination of runs). `storage_offset_in_file` is the byte offset of element 0 of
// the view's storage.
std::vector<Slice> view_to_slices(uint32_t file, uint64_t storage_offset_in_file, const TensorView& view,
                                  const std::vector<Runs>& runs);
// The whole view placed at `start` (ShardedTensor shards, plain tensors).
Slice view_to_slice(uint32_t file, uint64_t storage_offset_in_file, const TensorView& view,
                    const std::vector<int64_t>& start);

// A row-major dense region at `offset` placed at box [start, start + extent) (safetensors
// tensors, decoded DCP items).
Slice dense_slice(uint32_t file, uint64_t offset, DType dtype, const std::vector<int64_t>& start,
                  const std::vector<int64_t>& extent);

// Does `slices` tile [0, shape) exactly once? Returns a description of the first problem.
struct TilingProblem {
  enum class Kind { Overlap, Gap, OutOfBounds } kind;
  size_t first = 0;   // index of the offending slice
  size_t second = 0;  // the slice it overlaps (Overlap)
  std::string message;
};
std::optional<TilingProblem> check_tiling(const std::vector<int64_t>& shape, const std::vector<Slice>& slices);

}  // namespace shardmerge
