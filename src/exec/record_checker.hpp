// Checks the zip CRC-32 of every record a merge reads, from the bytes as they stream through
// the executor: each read reports (file, offset, bytes) to consume(), which CRCs the part that
// falls in each record and joins the pieces in record order (crc32_concat), whatever order the
// threads read them in. The first time all of a record's bytes have been seen, its CRC is
// compared with the central directory's. finish() reads and CRCs what no task read of the
// records that were touched (FSDP2's padded storage rows, parts of a record no slice needs), so
// every record read at all is checked whole. Bytes read twice (overlapping gathers) count once.
// Executors stay parse-free: the records come from the plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "shardmerge/plan.hpp"

namespace shardmerge {

struct SourceFds;

class RecordChecker {
 public:
  // `records` index `paths` (MergePlan::records and ::sources); records of one file must not
  // overlap (zip readers refuse archives whose records do).
  RecordChecker(std::vector<RecordCheck> records, std::vector<std::string> paths);
  ~RecordChecker();

  // `n` bytes read at `offset` of `file`. Throws an Error naming file, record, tensor and
  // offset when this completes a record whose CRC-32 is wrong. Safe to call from many threads.
  void consume(uint32_t file, uint64_t offset, const void* data, size_t n);

  // Reads the bytes not yet seen of every record that consume() touched, and checks them all.
  void finish(const SourceFds& sources);

  uint64_t records_checked() const;

 private:
  struct State;
  // Marks the parts of [lo, hi) (record-relative) that no earlier read claimed as this
  // caller's, and returns them.
  std::vector<std::pair<uint64_t, uint64_t>> claim(size_t record, uint64_t lo, uint64_t hi);
  // Stores the CRC of a claimed part; checks the record once all of it is in.
  void complete(size_t record, uint64_t lo, uint32_t crc);

  std::vector<RecordCheck> records_;
  std::vector<std::string> paths_;
  std::vector<std::vector<size_t>> by_file_;  // record indices by offset, per file
  std::unique_ptr<State[]> states_;
};

}  // namespace shardmerge
