#include "exec/sources.hpp"

#include <fcntl.h>

#include "shardmerge/error.hpp"

namespace shardmerge {

OpenSources::OpenSources(const std::vector<SourceFile>& sources) {
  for (const SourceFile& s : sources) {
    File f = File::open_read(s.path);
    if (f.size() != s.size)
      throw Error("changed since the plan was made (" + std::to_string(s.size) + " bytes then, " +
                  std::to_string(f.size()) + " now)")
          .file(s.path);
    ::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
    fds_.fds.push_back(f.fd());
    fds_.names.push_back(s.path);
    files_.push_back(std::move(f));
  }
}

}  // namespace shardmerge
