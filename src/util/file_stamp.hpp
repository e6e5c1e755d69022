// FileStamp (shardmerge/plan.hpp) of an open file, and what differs between two stamps: how
// a merge notices a source that was changed or replaced while it planned or ran.
#pragma once

#include <optional>
#include <string>

#include "shardmerge/plan.hpp"
#include "util/file.hpp"

namespace shardmerge {

FileStamp file_stamp(const File& file);
FileStamp file_stamp(int fd, const std::string& path);

// One line saying how `now` differs from `then` ("size 10 -> 12 bytes", "modified: mtime ..."),
// or nothing when they are equal.
std::optional<std::string> stamp_change(const FileStamp& then, const FileStamp& now);

}  // namespace shardmerge
