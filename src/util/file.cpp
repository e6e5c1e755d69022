#include "util/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

Error sys_error(const std::string& what, const std::string& path) {
  return Error(what + ": " + std::strerror(errno)).file(path);
}

}  // namespace

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() { close(); }

void File::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

File File::open_read(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw sys_error("cannot open for reading", path);
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw Error("is a directory, expected a file").file(path);
  }
  return File(fd, path);
}

File File::create(const std::string& path, bool overwrite) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | (overwrite ? O_TRUNC : O_EXCL), 0644);
  if (fd < 0) throw sys_error("cannot create", path);
  return File(fd, path);
}

File File::anonymous_temp() {
  const char* env = std::getenv("TMPDIR");
  const std::string dir = env && *env ? env : "/tmp";
  const std::string where = dir + "/(unnamed temp file)";
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // A filesystem without O_TMPFILE: a named file, unlinked at once.
    std::string name = dir + "/shardmerge-XXXXXX";
    fd = ::mkostemp(name.data(), O_CLOEXEC);
    if (fd < 0) throw sys_error("cannot create a temp file", dir);
    ::unlink(name.c_str());
  }
  if (fd < 0) throw sys_error("cannot create a temp file", dir);
  return File(fd, where);
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw sys_error("cannot stat", path_);
  return static_cast<uint64_t>(st.st_size);
}

void File::read_exact(uint64_t offset, void* buf, size_t n) const {
  auto* out = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw sys_error("read failed at byte " + std::to_string(offset + done), path_);
    }
    if (got == 0)
      throw Error("file is truncated: needed bytes [" + std::to_string(offset) + ", " +
                  std::to_string(offset + n) + ") but it ends at " + std::to_string(offset + done))
          .file(path_);
    done += static_cast<size_t>(got);
  }
}

std::string File::read_string(uint64_t offset, size_t n) const {
  std::string s(n, '\0');
  read_exact(offset, s.data(), n);
  return s;
}

void File::write_exact(uint64_t offset, const void* buf, size_t n) const {
  const auto* in = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t put = ::pwrite(fd_, in + done, n - done, static_cast<off_t>(offset + done));
    if (put < 0) {
      if (errno == EINTR) continue;
      throw sys_error("write failed at byte " + std::to_string(offset + done), path_);
    }
    done += static_cast<size_t>(put);
  }
}

void File::allocate(uint64_t size) const {
  if (size == 0) return;
  int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
  if (rc == 0) return;
  // Out of space fails now, before any tensor is written, not later in the middle of one.
  if (rc == ENOSPC || rc == EDQUOT || rc == EFBIG)
    throw Error("cannot reserve " + std::to_string(size) + " bytes: " + std::strerror(rc)).file(path_);
  // Filesystems without fallocate (some network/overlay mounts): a sparse file still works.
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) throw sys_error("cannot size output file", path_);
}

void File::sync() const {
  if (::fsync(fd_) != 0) throw sys_error("fsync failed", path_);
}

std::string read_small_file(const std::string& path, size_t max_bytes) {
  File f = File::open_read(path);
  uint64_t n = f.size();
  if (n > max_bytes)
    throw Error("file is " + std::to_string(n) + " bytes, more than the " + std::to_string(max_bytes) +
                " expected for this kind of file")
        .file(path);
  return f.read_string(0, static_cast<size_t>(n));
}

void write_small_file(const std::string& path, const std::string& content, bool overwrite) {
  File f = File::create(path, overwrite);
  f.write_exact(0, content.data(), content.size());
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace shardmerge
