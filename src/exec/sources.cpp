#include "exec/sources.hpp"

#include <fcntl.h>

#include "exec/io.hpp"
#include "shardmerge/error.hpp"
#include "util/file_stamp.hpp"

namespace shardmerge {

void SourceFds::read(uint32_t file, uint64_t offset, void* buf, size_t n) const {
  pread_exact(fds[file], offset, buf, n, names[file]);
  if (checker) checker->consume(file, offset, buf, n);
}

OpenSources::OpenSources(const MergePlan& plan, bool check_crc) {
  for (const SourceFile& s : plan.sources) {
    File f = File::open_read(s.path);
    const FileStamp now = file_stamp(f);
    if (now.size != s.size)
      throw Error("changed since the plan was made (" + std::to_string(s.size) + " bytes then, " +
                  std::to_string(now.size) + " now)")
          .file(s.path);
    if (s.planned)
      if (auto change = stamp_change(*s.planned, now)) throw Error("changed since the plan was made: " + *change).file(s.path);
    ::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
    fds_.fds.push_back(f.fd());
    fds_.names.push_back(s.path);
    opened_.push_back(now);
    files_.push_back(std::move(f));
  }
  if (check_crc && !plan.records.empty()) {
    checker_ = std::make_unique<RecordChecker>(plan.records, fds_.names);
    fds_.checker = checker_.get();
  }
}

uint64_t OpenSources::finish() {
  if (checker_) checker_->finish(fds_);
  for (size_t i = 0; i < files_.size(); ++i)
    if (auto change = stamp_change(opened_[i], file_stamp(files_[i])))
      throw Error("changed during the merge: " + *change).file(fds_.names[i]);
  return checker_ ? checker_->records_checked() : 0;
}

}  // namespace shardmerge
