// Positional I/O between files and buffers, with the kernel doing same-dtype copies itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardmerge {

void pread_exact(int fd, uint64_t offset, void* buf, size_t n, const std::string& what);
void pwrite_exact(int fd, uint64_t offset, const void* buf, size_t n, const std::string& what);

// Copies n bytes between files with copy_file_range, so they never pass through user memory.
// Returns how many bytes it copied: fewer than n where the kernel or filesystem cannot.
uint64_t copy_file_bytes(int in_fd, uint64_t in_offset, int out_fd, uint64_t out_offset, uint64_t n);

// Threads that read, cast and write when --threads is not given: two per core this process may
// run on. A merge whose checkpoint is not cached waits on the disk, and the second thread of a
// core keeps a read in flight while the first casts (7B shape, 30 GB not cached, 2 cores:
// 41-49 s with 4 threads, 45-49 s with 2, 49-51 s with 8).
unsigned default_io_threads();

}  // namespace shardmerge
