// The plan's source files, open for reading, and the one way executors read them: every read
// goes through SourceFds::read, which reports the bytes to the record checker (zip CRC-32s)
// when one is on. Executors refuse a file that changed since the plan was made (its offsets
// would point at other bytes) or while they ran.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exec/record_checker.hpp"
#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

struct SourceFds {
  std::vector<int> fds;
  std::vector<std::string> names;
  RecordChecker* checker = nullptr;  // null with --no-crc (or a plan without zip records)

  // pread of exactly n bytes, checked (the CRC-32 of the records they fall in) when a checker is on.
  void read(uint32_t file, uint64_t offset, void* buf, size_t n) const;
  // True when bytes must pass through user memory to be checked (no copy_file_range).
  bool checks_reads() const { return checker != nullptr; }
};

class OpenSources {
 public:
  // Opens every source of `plan`, refusing one whose stamp differs from the plan's.
  OpenSources(const MergePlan& plan, bool check_crc);
  const SourceFds& fds() const { return fds_; }

  // After the last read: checks what is left of the records read (bytes no task read), and
  // refuses a source whose stamp changed since it was opened. Returns the records checked.
  uint64_t finish();

 private:
  std::vector<File> files_;
  std::vector<FileStamp> opened_;
  std::unique_ptr<RecordChecker> checker_;
  SourceFds fds_;
};

}  // namespace shardmerge
