// An exclusive lock on a path that is not opened itself (an output directory that does not
// exist yet): flock on a lock file beside it, taken without waiting. The file is removed when
// the lock is released; a file left by a killed process holds no lock (flock ends with the
// process) and is taken over by the next one.
#pragma once

#include <string>

namespace shardmerge {

class DirLock {
 public:
  DirLock() = default;
  // Locks `lock_file` (created if missing). Returns an unlocked DirLock when another process
  // holds it.
  static DirLock try_lock(const std::string& lock_file);
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();

  bool locked() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // Removes the lock file, then unlocks.
  void release();

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace shardmerge
