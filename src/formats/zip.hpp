// Reader for the zip container of torch.save files: central directory, ZIP64 records, and the
// absolute byte offset of every record's data, so tensor bytes are read in place, never
// extracted. Local headers (and data descriptors) are checked against the central directory. Only STORED entries are accepted (torch never compresses; a compressed entry
// would also defeat reading tensors in place).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "util/file.hpp"

namespace shardmerge {

struct ZipEntry {
  std::string name;
  uint64_t data_offset = 0;  // absolute offset in the file of the first data byte
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

class ZipArchive {
 public:
  // Parses the archive that occupies [base, base + length) of `file` (a DCP .distcp item is
  // a whole zip embedded at an offset); length defaults to the rest of the file.
  static ZipArchive read(const File& file, uint64_t base = 0, std::optional<uint64_t> length = {});

  const std::vector<ZipEntry>& entries() const { return entries_; }
  const ZipEntry* find(std::string_view name) const;

 private:
  static ZipArchive read_directory(const File& file, uint64_t base, std::optional<uint64_t> length);

  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string, size_t> by_name_;
};

// Local-header vocabulary shared with the prefix reader (formats/zip_prefix.hpp).
constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kDataDescriptorSig = 0x08074b50;
constexpr uint16_t kDataDescriptorFlag = 0x0008;  // CRC and sizes follow the data
// Reads the ZIP64 extended-information extra field, replacing the 0xFFFFFFFF sentinels.
void apply_zip64_extra(std::string_view extra, uint64_t& usize, uint64_t& csize, uint64_t& lho, const std::string& name);
// The extra field `id` of an extra block, if present.
std::optional<std::string_view> extra_field(std::string_view extra, uint16_t id);

// The bytes of `entry`, checked against its CRC-32 (a mismatch is an Error naming the record).
std::string read_record_checked(const File& file, const ZipEntry& entry);

// A torch.save archive: every entry is "<archive>/<record>" for one shared archive name.
class TorchArchive {
 public:
  static TorchArchive read(const File& file, uint64_t base = 0, std::optional<uint64_t> length = {});

  const std::string& archive_name() const { return prefix_; }
  const ZipEntry* find_record(std::string_view record) const;  // e.g. "data.pkl", "data/0"
  const ZipEntry& record(std::string_view record) const;       // throws when absent
  const ZipArchive& zip() const { return zip_; }

 private:
  ZipArchive zip_;
  std::string prefix_;
  std::string path_;
};

}  // namespace shardmerge
