// Writes a MergePlan's output tree atomically: everything goes into `<target>.tmp-<pid>-<n>`
// beside the target (safetensors files preallocated with their headers, index, sidecars),
// is fsynced, and only then renamed to the target. Any failure removes the temp directory and
// leaves the target as it was.
#pragma once

#include <string>
#include <vector>

#include "shardmerge/executor.hpp"
#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

class HfTreeWriter : public OutputSink {
 public:
  // Refuses an existing non-empty target unless `force`, and a target inside `source_dir`
  // (the source checkpoint is never modified).
  HfTreeWriter(std::string target, bool force, const std::string& source_dir);
  HfTreeWriter(const HfTreeWriter&) = delete;
  HfTreeWriter& operator=(const HfTreeWriter&) = delete;
  ~HfTreeWriter() override;

  // Creates the temp directory and the plan's files, sized, with their headers written.
  void create(const MergePlan& plan);
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override;
  bool copy_from(int src_fd, uint64_t src_offset, uint32_t file, uint64_t offset, uint64_t n) const override;
  // Writes the sidecars, fsyncs everything and renames the temp directory to the target.
  void commit(const MergePlan& plan);

  const std::string& temp_dir() const { return temp_; }

 private:
  std::string target_;
  std::string temp_;
  bool force_;
  bool committed_ = false;
  std::vector<File> files_;
};

}  // namespace shardmerge
