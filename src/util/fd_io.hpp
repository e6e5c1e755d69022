// Positional I/O between file descriptors and buffers, with the kernel doing same-dtype copies
// itself. Short reads are errors naming the file and offset.
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

}  // namespace shardmerge
