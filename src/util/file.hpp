// Thin RAII wrapper over a POSIX file descriptor: positional reads and writes that either
// transfer every byte or throw an Error naming the file and the offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardmerge {

class File {
 public:
  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  static File open_read(const std::string& path);
  // Creates a file for writing; fails if it exists unless `overwrite`.
  static File create(const std::string& path, bool overwrite = false);
  // A file for reading and writing with no name, in $TMPDIR (or /tmp): nothing is left behind
  // once it is closed, even when the process is killed. `path()` says where it is, for errors.
  static File anonymous_temp();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  uint64_t size() const;

  // Reads exactly n bytes at offset; a short read is reported as a truncated file.
  void read_exact(uint64_t offset, void* buf, size_t n) const;
  std::string read_string(uint64_t offset, size_t n) const;
  void write_exact(uint64_t offset, const void* buf, size_t n) const;
  // Reserves `size` bytes (fallocate where the filesystem supports it, else ftruncate).
  void allocate(uint64_t size) const;
  void sync() const;
  void close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// Whole small files (JSON, trackers); refuses anything larger than max_bytes.
std::string read_small_file(const std::string& path, size_t max_bytes = 64u << 20);
void write_small_file(const std::string& path, const std::string& content, bool overwrite = false);
// Makes the entries of a directory (creations, renames, removals) durable; best effort.
void fsync_dir(const std::string& dir);

}  // namespace shardmerge
