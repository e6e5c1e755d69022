// Writes torch.save archives the way torch's PyTorchStreamWriter (miniz) does: stored records
// under "<archive>/", data 64-byte aligned with an "FB" padding extra field, data descriptors
// with real CRC-32s, ZIP64 fields where sizes or offsets pass 4 GiB, and ZIP64 end records.
// Records stream: large storages are written in chunks, never held whole.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "util/file.hpp"

namespace shardmerge {

class TorchArchiveWriter {
 public:
  TorchArchiveWriter(const std::string& path, std::string archive_name);

  void add_record(const std::string& name, const std::string& data);
  // Streams `size` bytes: `fill(buf, n)` is called repeatedly to produce the next n bytes.
  void add_record(const std::string& name, uint64_t size, const std::function<void(char*, size_t)>& fill);
  // Writes `version` and the central directory; the file is complete after this.
  void finish();

 private:
  struct Entry {
    std::string name;
    uint64_t header_offset, size;
    uint32_t crc;
  };
  uint64_t begin_record(const std::string& full_name, uint64_t size);
  void end_record(uint64_t header_offset, const std::string& full_name, uint64_t size, uint32_t crc);

  File file_;
  std::string prefix_;
  uint64_t cursor_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace shardmerge
