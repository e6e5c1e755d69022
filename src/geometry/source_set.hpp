// What a layout reader hands to the planner: every tensor of the checkpoint with its global
// shape and dtype, and the strided source regions that hold it. Names are as saved.
#pragma once

#include <string>
#include <vector>

#include "formats/zip.hpp"
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
  std::vector<RecordCheck> records;   // the zip records the pieces read (torch.save sources), any order
  std::vector<std::string> notes;
};

// The check of the zip record `entry` of source file `file`, which holds `tensor`'s bytes.
RecordCheck record_check(uint32_t file, const ZipEntry& entry, const std::string& tensor);

// `records` by file and offset, one per record: tensors that share a storage name it once
// (the first one described).
std::vector<RecordCheck> unique_records(std::vector<RecordCheck> records);

// Appends `more` to `set`, renumbering its file indices. Returns the index of its first tensor.
size_t append_sources(SourceSet& set, SourceSet more);

}  // namespace shardmerge
