#include "layouts/sources.hpp"

namespace shardmerge {

size_t append_sources(SourceSet& set, SourceSet more) {
  const auto file_base = static_cast<uint32_t>(set.files.size());
  const size_t first = set.tensors.size();
  set.files.insert(set.files.end(), more.files.begin(), more.files.end());
  for (SourceTensor& t : more.tensors) {
    for (Slice& s : t.pieces) s.file += file_base;
    set.tensors.push_back(std::move(t));
  }
  set.notes.insert(set.notes.end(), more.notes.begin(), more.notes.end());
  return first;
}

}  // namespace shardmerge
