#include "util/free_space.hpp"

#include <sys/statvfs.h>

#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge {

std::optional<uint64_t> free_bytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0 || s.f_frsize == 0) return std::nullopt;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

void require_free_space(uint64_t needed, std::optional<uint64_t> available, const std::string& where) {
  if (!available || needed <= *available) return;
  throw Error("not enough free space: the output needs " + format_bytes(needed) + ", the filesystem has " +
              format_bytes(*available) + " free")
      .file(where);
}

}  // namespace shardmerge
