// What a layout reader hands to the planner: every tensor of the checkpoint with its global
// shape and dtype, and the strided source regions that hold it. Names are as saved.
#pragma once

#include <string>
#include <vector>

#include "shardmerge/plan.hpp"

namespace shardmerge {

struct SourceTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<Slice> pieces;  // tile `shape` exactly once
  std::string origin;         // e.g. "Shard(0) x4", "replicated"
};

struct SourceSet {
  std::string description;  // one line: backend, world size, mesh
  std::vector<SourceFile> files;
  std::vector<SourceTensor> tensors;  // in checkpoint order
  std::vector<std::string> notes;
};

// Appends `more` to `set`, renumbering its file indices. Returns the index of its first tensor.
size_t append_sources(SourceSet& set, SourceSet more);

}  // namespace shardmerge
