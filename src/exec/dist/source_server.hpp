// The sources this process owns, served to the processes that read them (the owner's side of
// DataPlane): each is opened on its first request, its stamp checked against the plan (a
// compressed item decoded, once), and checked again at the end. The asking process checks the
// zip CRC-32s of what it receives, as it does for its own reads.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "exec/sources.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge::dist {

class SourceServer {
 public:
  SourceServer(const MergePlan& plan, int32_t rank) : plan_(plan), rank_(rank), open_(plan.sources.size()) {}
  // Exactly n bytes of source `file`; refuses a source this process does not own.
  void read(uint32_t file, uint64_t offset, void* buf, size_t n);
  // Refuses a served source that changed while it was served.
  void finish();

 private:
  const MergePlan& plan_;
  int32_t rank_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<OpenSources>> open_;  // by source index, once asked for
};

}  // namespace shardmerge::dist
