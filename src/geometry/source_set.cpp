#include "geometry/source_set.hpp"

#include <algorithm>
#include <tuple>

namespace shardmerge {

size_t append_sources(SourceSet& set, SourceSet more) {
  const auto file_base = static_cast<uint32_t>(set.files.size());
  const size_t first = set.tensors.size();
  set.files.insert(set.files.end(), more.files.begin(), more.files.end());
  for (SourceTensor& t : more.tensors) {
    for (Slice& s : t.pieces) s.file += file_base;
    set.tensors.push_back(std::move(t));
  }
  for (RecordCheck& r : more.records) {
    r.file += file_base;
    set.records.push_back(std::move(r));
  }
  set.notes.insert(set.notes.end(), more.notes.begin(), more.notes.end());
  return first;
}

RecordCheck record_check(uint32_t file, const ZipEntry& entry, const std::string& tensor) {
  return {file, entry.data_offset, entry.size, entry.crc32, entry.name, tensor};
}

std::vector<RecordCheck> unique_records(std::vector<RecordCheck> records) {
  std::stable_sort(records.begin(), records.end(), [](const RecordCheck& a, const RecordCheck& b) {
    return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
  });
  records.erase(std::unique(records.begin(), records.end(),
                            [](const RecordCheck& a, const RecordCheck& b) { return a.file == b.file && a.offset == b.offset; }),
                records.end());
  return records;
}

}  // namespace shardmerge
