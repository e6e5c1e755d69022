// The plan's source files that the executor's tasks read, open for reading, and the one way
// executors read them: every read goes through SourceFds::read, which reports the bytes to the
// record checker (zip CRC-32s) when one is on. Executors refuse a file that changed since the
// plan was made (its offsets would point at other bytes) or while they ran, and one that
// another process owns. A compressed source is decoded when it is opened, into an unnamed
// temp file that its reads (and its records, which address decoded bytes) then go to.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "exec/record_checker.hpp"
#include "shardmerge/executor.hpp"
#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

// Bytes of source reads issued and not yet returned, and the most there ever were: how deep the
// executors keep the disk's queue (`merge --json` reports the peak; `shardmerge bench` prints it).
class ReadsInFlight {
 public:
  void begin(uint64_t n) {
    const uint64_t now = now_.fetch_add(n, std::memory_order_relaxed) + n;
    uint64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void end(uint64_t n) { now_.fetch_sub(n, std::memory_order_relaxed); }
  uint64_t peak() const { return peak_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> now_{0}, peak_{0};
};

struct SourceFds {
  std::vector<int> fds;             // by MergePlan::sources index; -1 for a source not opened here
  std::vector<std::string> names;   // every source's path
  std::vector<int32_t> remote_owner;  // by source index: the rank whose reads `remote` asks for, or -1
  RemoteReader* remote = nullptr;
  RecordChecker* checker = nullptr;  // null with --no-crc (or a plan without zip records)
  ReadsInFlight* in_flight = nullptr;  // counted when set

  // Exactly n bytes (pread, or a remote read of a source another process holds), checked (the
  // CRC-32 of the records they fall in) when a checker is on.
  void read(uint32_t file, uint64_t offset, void* buf, size_t n) const;
  // The same bytes, unchecked: the record checker's own reads.
  void read_unchecked(uint32_t file, uint64_t offset, void* buf, size_t n) const;
  // True when the bytes of `file` must pass through user memory: to be checked, or because
  // another process reads them (no copy_file_range).
  bool must_read(uint32_t file) const { return checker != nullptr || fds[file] < 0; }
};

class OpenSources {
 public:
  // Opens the sources `files` of `plan` (what the tasks read: source_files_read) and no other,
  // refusing one whose stamp differs from the plan's. A source owned by a process other than
  // `rank` (this process's rank in a multi-process merge; -1, a single process, reads any) is
  // read through `remote`, or refused without one.
  OpenSources(const MergePlan& plan, const std::vector<uint32_t>& files, bool check_crc, int32_t rank,
              RemoteReader* remote = nullptr);
  const SourceFds& fds() const { return fds_; }

  // After the last read: checks what is left of the records read (bytes no task read), and
  // refuses an opened source whose stamp changed since it was opened (a compressed source's
  // file itself, not its decoded copy). Returns the records checked.
  uint64_t finish();
  // The most bytes of reads through fds() in flight at once.
  uint64_t peak_read_bytes_in_flight() const { return in_flight_->peak(); }

 private:
  std::vector<uint32_t> opened_index_;  // into MergePlan::sources, a source of each of files_
  std::vector<File> files_;               // one per path
  std::vector<FileStamp> opened_;
  std::vector<File> decoded_;  // unnamed temp files holding compressed sources, decoded
  std::unique_ptr<RecordChecker> checker_;
  std::unique_ptr<ReadsInFlight> in_flight_ = std::make_unique<ReadsInFlight>();
  SourceFds fds_;
};

}  // namespace shardmerge
