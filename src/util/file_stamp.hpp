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

// What must match for a file to count as unchanged. Exact: the same file, untouched (a merge
// planned and run by one process). SizeAndMtime: the same size and mtime (a plan file run on
// another machine or over a copied tree sees the same file with another inode, device, ctime).
enum class StampMatch { Exact, SizeAndMtime };

// One line saying how `now` differs from `then` ("size 10 -> 12 bytes", "modified: mtime ..."),
// or nothing when they match.
std::optional<std::string> stamp_change(const FileStamp& then, const FileStamp& now, StampMatch match);

}  // namespace shardmerge
