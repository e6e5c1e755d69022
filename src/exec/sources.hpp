// The plan's source files, open for reading. Executors refuse a file whose size changed since
// the plan was made: its offsets would point at other bytes.
#pragma once

#include <string>
#include <vector>

#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

struct SourceFds {
  std::vector<int> fds;
  std::vector<std::string> names;
};

class OpenSources {
 public:
  explicit OpenSources(const std::vector<SourceFile>& sources);
  const SourceFds& fds() const { return fds_; }

 private:
  std::vector<File> files_;
  SourceFds fds_;
};

}  // namespace shardmerge
