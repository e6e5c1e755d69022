#include "util/dir_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "shardmerge/error.hpp"

namespace shardmerge {

DirLock DirLock::try_lock(const std::string& lock_file) {
  // The holder unlinks the file before unlocking: a process that opened the old file and then
  // got its lock holds a lock on a name that is gone, and must try the file now there.
  for (;;) {
    const int fd = ::open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) throw Error(std::string("cannot create the lock file: ") + std::strerror(errno)).file(lock_file);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return DirLock();
      throw Error(std::string("cannot lock: ") + std::strerror(err)).file(lock_file);
    }
    struct stat held {}, named {};
    if (::fstat(fd, &held) == 0 && ::stat(lock_file.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      DirLock lock;
      lock.fd_ = fd;
      lock.path_ = lock_file;
      return lock;
    }
    ::close(fd);
  }
}

DirLock::DirLock(DirLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

DirLock::~DirLock() { release(); }

void DirLock::release() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

}  // namespace shardmerge
