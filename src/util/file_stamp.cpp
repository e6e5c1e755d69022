#include "util/file_stamp.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "shardmerge/error.hpp"

namespace shardmerge {

FileStamp file_stamp(const File& file) { return file_stamp(file.fd(), file.path()); }

FileStamp file_stamp(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(std::string("cannot stat: ") + std::strerror(errno)).file(path);
  FileStamp s;
  s.size = static_cast<uint64_t>(st.st_size);
  s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  s.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  s.inode = static_cast<uint64_t>(st.st_ino);
  s.device = static_cast<uint64_t>(st.st_dev);
  return s;
}

std::optional<std::string> stamp_change(const FileStamp& then, const FileStamp& now, StampMatch match) {
  if (match == StampMatch::Exact && (then.inode != now.inode || then.device != now.device))
    return "replaced by another file (inode changed)";
  if (then.size != now.size) return "size " + std::to_string(then.size) + " -> " + std::to_string(now.size) + " bytes";
  if (then.mtime_ns != now.mtime_ns) return "modified (mtime changed)";
  if (match == StampMatch::SizeAndMtime) return std::nullopt;
  // ctime also moves on a write whose mtime was set back (touch -d, cp -p over the file).
  if (then.ctime_ns != now.ctime_ns) return "modified (ctime changed)";
  return std::nullopt;
}

}  // namespace shardmerge
