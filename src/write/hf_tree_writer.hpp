// Writes a MergePlan's output tree atomically: everything goes into `<target>.tmp-<pid>-<n>`
// beside the target (symlinks resolved, so the final rename stays on one filesystem): the
// safetensors files preallocated with their headers, the index, the sidecars; fsynced, and only
// then renamed to the target. The creating process holds a lock beside the target for the
// whole run, so a second merge into it fails at once; it first removes what killed runs left
// there (see stale_temps.hpp). A failure or SIGINT/SIGTERM/SIGHUP (util/interrupt.hpp) removes
// the temp directory and the parent directories this run created, and leaves the target as it
// was: the rename replaces only a missing or empty target, and a non-empty one only with
// --force (an atomic exchange where the filesystem has one).
#pragma once

#include <string>
#include <vector>

#include "shardmerge/executor.hpp"
#include "shardmerge/plan.hpp"
#include "util/dir_lock.hpp"
#include "util/file.hpp"
#include "util/interrupt.hpp"

namespace shardmerge {

class HfTreeWriter : public OutputSink {
 public:
  // Refuses an existing non-empty target unless `force`, and a target inside `source_dir`
  // (the source checkpoint is never modified); create/attach check that --force replaces
  // no file the plan reads. Touches nothing on disk.
  HfTreeWriter(std::string target, bool force, const std::string& source_dir);
  HfTreeWriter(const HfTreeWriter&) = delete;
  HfTreeWriter& operator=(const HfTreeWriter&) = delete;
  ~HfTreeWriter() override;

  // Creates the missing parent directories, locks the target, checks it again, removes stale
  // temp directories (printing a note for each), checks the free space, and creates the temp
  // directory and the plan's files, sized (preallocated), with their headers written. `owned`
  // (a flag per plan file; empty means all) limits this process to its share of the files
  // when several processes write one tree.
  void create(const MergePlan& plan, const std::vector<bool>& owned = {});
  // Joins the temp directory that another process created (see create) and creates the files
  // this process owns there. A joined directory is never removed or renamed by this object,
  // but by remove_joined.
  void attach(const std::string& temp_dir, const MergePlan& plan, const std::vector<bool>& owned);
  // Removes a joined temp directory and its creator's lock file: for when the creator is gone
  // (a peer that stopped answering, which may not run again to clean up: a hung node).
  void remove_joined();
  // Creates this process's files in the temp directory (create and attach do), again: rank 0
  // creates the directory before it knows its share.
  void create_files(const MergePlan& plan, const std::vector<bool>& owned);
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override;
  bool copy_from(int src_fd, uint64_t src_offset, uint32_t file, uint64_t offset, uint64_t n) const override;
  // fsyncs the files this process wrote.
  void sync_files();
  // Writes the sidecars, fsyncs everything and renames the temp directory to the target
  // (with several processes: once every process has synced its files). Fails, leaving the
  // target alone, when it became non-empty during the merge and --force was not given.
  void commit(const MergePlan& plan);

  const std::string& temp_dir() const { return temp_; }
  // The directory the output is renamed to: the target with its symlinks resolved.
  const std::string& resolved_target() const { return target_; }
  // Usage errors for a target inside `source_dir`, or (with --force) one that holds it. The
  // constructor checks its own `source_dir`; fold-lora adds the base model's directory.
  void refuse_overlap(const std::string& source_dir) const;

 private:
  std::string display_;  // the target as the user wrote it, for messages
  std::string target_;   // absolute, symlinks resolved
  std::string temp_;
  bool force_;
  bool created_ = false;
  bool committed_ = false;
  bool attached_ = false;
  std::vector<std::string> created_parents_;  // outermost first
  std::vector<interrupt::Registration> cleanup_;  // parents, lock file: removed on a signal
  interrupt::Registration temp_cleanup_;         // the temp dir while it is there
  DirLock lock_;
  std::vector<File> files_;  // by plan file index; unopened where another process writes it
  // Usage errors for a target that is not a directory, or not empty without --force.
  void check_target() const;
  void create_parents();
  void lock_target();
  std::string lock_file() const;  // beside the target
  void require_space(const MergePlan& plan) const;
  // Renames the temp directory to the target, under interrupt::hold_off().
  void publish();
  // --force must not replace a directory holding any file the plan reads.
  void refuse_replacing_sources(const MergePlan& plan) const;
};

}  // namespace shardmerge
