// Free space on a filesystem, checked before an output is written: a merge that cannot fit
// fails at once instead of after writing most of its bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace shardmerge {

// Bytes an unprivileged writer may still use on the filesystem holding `path` (statvfs
// f_bavail x f_frsize), or nothing when the filesystem does not say.
std::optional<uint64_t> free_bytes(const std::string& path);

// Throws an Error naming `where` when `needed` bytes are more than `available`.
void require_free_space(uint64_t needed, std::optional<uint64_t> available, const std::string& where);

}  // namespace shardmerge
