// The I/O half of reshard: the source rank files of one kind (model_ or optim_) opened and
// checked, a RowMoves plan per DTensor, and target rank files written by re-emitting source
// rank 0's pickle with every DTensor rebuilt for the target mesh (its rows streamed from the
// source ranks that hold them) and everything else copied as it was: dict keys and order,
// OrderedDict and its _metadata, param_groups (floats exact), plain tensors (step counters,
// replicated buffers: from source rank 0, where FSDP keeps them replicated). Memory: one
// 8 MiB copy buffer and the pickles, whatever the checkpoint's size.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "formats/pickle.hpp"
#include "formats/torch_pt.hpp"
#include "reshard/row_moves.hpp"
#include "reshard/target.hpp"
#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {
class RecordChecker;
}

namespace shardmerge::reshard {

// Every source file read, opened once; reads of zip records are CRC-checked as they stream
// (the parts no target needs, such as FSDP2's padding rows, are read at finish()).
class SourceReader {
 public:
  explicit SourceReader(bool check_crc);
  ~SourceReader();
  uint32_t add(const std::string& path);
  void add_record(uint32_t file, const ZipEntry& record, const std::string& tensor);
  // After the last add_record, before the first read.
  void start();
  void read(uint32_t file, uint64_t offset, void* buf, size_t n) const;
  // Checks what is left of the records read, and refuses a source that changed since it was
  // opened (stamps).
  void finish();
  const std::string& path(uint32_t file) const { return paths_[file]; }

 private:
  bool check_crc_;
  std::vector<File> files_;
  std::vector<std::string> paths_;
  std::vector<FileStamp> stamps_;
  std::vector<RecordCheck> records_;
  std::unique_ptr<RecordChecker> checker_;
};

struct DTensorPlan {
  DType dtype = DType::F32;
  std::vector<int64_t> global_size;
  int64_t row_elems = 0;   // elements per dim-0 row
  bool padded = false;     // target storages hold ceil(dim0 / F) rows
  std::vector<TargetRows> targets;   // by target fsdp index
  std::vector<uint64_t> row0_offset;  // by source rank: file offset of local row 0
};

// The rank files of one kind ("model" or "optim") of a source world of `paths.size()` ranks.
struct SourceKind {
  std::string prefix;
  std::vector<uint32_t> files;        // SourceReader ids, by source rank
  pickle::Document templ;             // source rank 0's data.pkl
  uint64_t template_bytes = 0;        // its size
  std::map<std::string, DTensorPlan> dtensors;  // by name (dotted path)
  struct Plain {
    TensorView view;
    uint64_t storage_offset_in_file = 0;
  };
  std::map<std::string, Plain> plain;  // tensors that are not DTensors, from rank 0
  // Bytes of every target rank's storages, for the free-space check.
  uint64_t target_bytes(const TargetMesh& mesh) const;
};

// Opens and checks the files (same tensors on every rank; DTensors on a data-parallel mesh of
// the source world size, sharded along dim 0 only; in optimizer files every tensor with more
// than one element a DTensor) and plans every DTensor's rows for `mesh`. Throws an Error
// naming the file and tensor of the first problem.
SourceKind plan_kind(const std::string& prefix, const std::vector<std::string>& paths, const TargetMesh& mesh,
                     SourceReader& reader);

// Writes target rank `rank`'s file of that kind at `path`; returns its size.
uint64_t write_target_file(const SourceKind& kind, const TargetMesh& mesh, int64_t rank, const SourceReader& reader,
                           const std::string& path);

}  // namespace shardmerge::reshard
