#include "util/fd_io.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "shardmerge/error.hpp"

namespace shardmerge {

void pread_exact(int fd, uint64_t offset, void* buf, size_t n, const std::string& what) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(std::string("read failed: ") + std::strerror(errno)).file(what).offset(offset);
    if (got == 0) throw Error("file is truncated (it changed since planning?)").file(what).offset(offset);
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
}

void pwrite_exact(int fd, uint64_t offset, const void* buf, size_t n, const std::string& what) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t put = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) throw Error(std::string("write failed: ") + std::strerror(errno)).file(what).offset(offset);
    p += put;
    offset += static_cast<uint64_t>(put);
    n -= static_cast<size_t>(put);
  }
}

uint64_t copy_file_bytes(int in_fd, uint64_t in_offset, int out_fd, uint64_t out_offset, uint64_t n) {
  uint64_t done = 0;
  while (done < n) {
    auto in_off = static_cast<off64_t>(in_offset + done), out_off = static_cast<off64_t>(out_offset + done);
    ssize_t got = ::copy_file_range(in_fd, &in_off, out_fd, &out_off, n - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;  // unsupported here (EXDEV, ENOSYS, EINVAL...) or an early end of file
    done += static_cast<uint64_t>(got);
  }
  return done;
}

}  // namespace shardmerge
