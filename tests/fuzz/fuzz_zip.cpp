// libFuzzer target: the zip directory reader, the torch.save archive checks and the whole
// TorchFile::open (archive + pickle + storage records) on an arbitrary file. The input goes
// into a memfd so the reader sees a real file descriptor, as it does for checkpoints. A
// shardmerge::Error is the expected rejection.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <variant>

#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace {

int write_memfd(const uint8_t* data, size_t size) {
  const int fd = ::memfd_create("fuzz_zip", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<size_t>(n);
  }
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = write_memfd(data, size);
  // File::open_read wants a path; /proc/self/fd/N reopens the same memory file.
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const shardmerge::File file = shardmerge::File::open_read(path);
    try {
      const auto zip = shardmerge::ZipArchive::read(file);
      for (const auto& entry : zip.entries())
        if (entry.data_offset + entry.size > file.size()) std::abort();  // the reader promised in-bounds data
    } catch (const shardmerge::Error&) {
    }
    try {
      const auto archive = shardmerge::TorchArchive::read(file);
      (void)archive.find_record("data.pkl");
    } catch (const shardmerge::Error&) {
    }
    try {
      const auto torch_file = shardmerge::TorchFile::open(path);
      for (const auto& entry : torch_file.entries())
        if (const auto* view = std::get_if<shardmerge::TensorView>(&entry.value))
          if (torch_file.storage_offset_in_file(*view) + view->storage_nbytes > file.size()) std::abort();
    } catch (const shardmerge::Error&) {
    }
  } catch (const shardmerge::Error&) {
  }
  ::close(fd);
  return 0;
}
