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
  // (the source checkpoint is never modified); create/attach check that --force replaces
  // no file the plan reads.
  HfTreeWriter(std::string target, bool force, const std::string& source_dir);
  HfTreeWriter(const HfTreeWriter&) = delete;
  HfTreeWriter& operator=(const HfTreeWriter&) = delete;
  ~HfTreeWriter() override;

  // Creates the temp directory and the plan's files, sized, with their headers written.
  // `owned` (a flag per plan file; empty means all) limits this process to its share of the
  // files when several processes write one tree.
  void create(const MergePlan& plan, const std::vector<bool>& owned = {});
  // Joins the temp directory that another process created (see create) and creates the files
  // this process owns there. A joined directory is never removed or renamed by this object.
  void attach(const std::string& temp_dir, const MergePlan& plan, const std::vector<bool>& owned);
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override;
  bool copy_from(int src_fd, uint64_t src_offset, uint32_t file, uint64_t offset, uint64_t n) const override;
  // fsyncs the files this process wrote.
  void sync_files();
  // Writes the sidecars, fsyncs everything and renames the temp directory to the target
  // (with several processes: once every process has synced its files).
  void commit(const MergePlan& plan);

  const std::string& temp_dir() const { return temp_; }
  // Usage errors for a target inside `source_dir`, or (with --force) one that holds it. The
  // constructor checks its own `source_dir`; fold-lora adds the base model's directory.
  void refuse_overlap(const std::string& source_dir) const;

 private:
  std::string target_;
  std::string temp_;
  bool force_;
  bool committed_ = false;
  bool attached_ = false;
  std::vector<File> files_;  // by plan file index; unopened where another process writes it
  void create_files(const MergePlan& plan, const std::vector<bool>& owned);
  // --force must not replace a directory holding any file the plan reads.
  void refuse_replacing_sources(const MergePlan& plan) const;
};

}  // namespace shardmerge
