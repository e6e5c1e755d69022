#include "exec/record_checker.hpp"

#include <algorithm>
#include <cstdio>

#include "exec/sources.hpp"
#include "shardmerge/error.hpp"
#include "util/crc32.hpp"

namespace shardmerge {
namespace {

std::string hex32(uint32_t v) {
  char buf[11];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

constexpr size_t kGapReadBytes = 1u << 20;

}  // namespace

// Parts of one record seen so far, keyed by record-relative start. A part is claimed by the
// read that saw its bytes first, and done once its CRC is in; adjacent done parts are joined,
// so a record read front to back stays one part.
struct RecordChecker::State {
  struct Part {
    uint64_t end = 0;
    uint32_t crc = 0;
    bool done = false;
  };
  std::mutex mutex;
  std::map<uint64_t, Part> parts;
  uint64_t done_bytes = 0;
  bool checked = false;
};

RecordChecker::RecordChecker(std::vector<RecordCheck> records, std::vector<std::string> paths)
    : records_(std::move(records)), paths_(std::move(paths)), by_file_(paths_.size()),
      states_(std::make_unique<State[]>(records_.size())) {
  for (size_t i = 0; i < records_.size(); ++i) {
    if (records_[i].file >= paths_.size())
      throw Error("plan error: record " + records_[i].record + " names source file " + std::to_string(records_[i].file) +
                  " of " + std::to_string(paths_.size()));
    if (records_[i].size > 0) by_file_[records_[i].file].push_back(i);  // an empty record holds no byte to read
  }
  for (size_t f = 0; f < by_file_.size(); ++f) {
    auto& list = by_file_[f];
    std::sort(list.begin(), list.end(), [&](size_t a, size_t b) { return records_[a].offset < records_[b].offset; });
    for (size_t k = 1; k < list.size(); ++k) {
      const RecordCheck& prev = records_[list[k - 1]];
      if (prev.offset + prev.size > records_[list[k]].offset)
        throw Error("zip records " + prev.record + " and " + records_[list[k]].record + " overlap")
            .file(paths_[f])
            .offset(records_[list[k]].offset);
    }
  }
}

RecordChecker::~RecordChecker() = default;

void RecordChecker::consume(uint32_t file, uint64_t offset, const void* data, size_t n) {
  if (n == 0 || file >= by_file_.size()) return;
  const auto& list = by_file_[file];
  const uint64_t end = offset + n;
  // Records of a file are disjoint, so sorting by offset sorts their ends too.
  auto it = std::partition_point(list.begin(), list.end(),
                                 [&](size_t i) { return records_[i].offset + records_[i].size <= offset; });
  for (; it != list.end() && records_[*it].offset < end; ++it) {
    const RecordCheck& r = records_[*it];
    const uint64_t lo = std::max(offset, r.offset) - r.offset, hi = std::min(end, r.offset + r.size) - r.offset;
    if (lo >= hi) continue;
    for (const auto& [a, b] : claim(*it, lo, hi))
      complete(*it, a, crc32_update(0, static_cast<const uint8_t*>(data) + (r.offset + a - offset), b - a));
  }
}

std::vector<std::pair<uint64_t, uint64_t>> RecordChecker::claim(size_t record, uint64_t lo, uint64_t hi) {
  State& s = states_[record];
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (s.checked) return out;
  auto it = s.parts.upper_bound(lo);
  if (it != s.parts.begin() && std::prev(it)->second.end > lo) --it;
  for (uint64_t pos = lo; pos < hi; ++it) {
    if (it == s.parts.end() || it->first >= hi) {
      out.emplace_back(pos, hi);
      break;
    }
    if (it->first > pos) out.emplace_back(pos, it->first);
    pos = std::max(pos, it->second.end);
  }
  for (const auto& [a, b] : out) s.parts.emplace(a, State::Part{b, 0, false});
  return out;
}

void RecordChecker::complete(size_t record, uint64_t lo, uint32_t crc) {
  const RecordCheck& r = records_[record];
  State& s = states_[record];
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.parts.find(lo);
  it->second.crc = crc;
  it->second.done = true;
  s.done_bytes += it->second.end - lo;
  if (auto next = std::next(it); next != s.parts.end() && next->first == it->second.end && next->second.done) {
    it->second.crc = crc32_concat(it->second.crc, next->second.crc, next->second.end - next->first);
    it->second.end = next->second.end;
    s.parts.erase(next);
  }
  if (it != s.parts.begin())
    if (auto prev = std::prev(it); prev->second.end == it->first && prev->second.done) {
      prev->second.crc = crc32_concat(prev->second.crc, it->second.crc, it->second.end - it->first);
      prev->second.end = it->second.end;
      s.parts.erase(it);
    }
  if (s.done_bytes < r.size) return;
  s.checked = true;
  const uint32_t seen = s.parts.begin()->second.crc;
  s.parts.clear();
  if (seen != r.crc32)
    throw Error("CRC-32 mismatch: record " + r.record + " (" + std::to_string(r.size) + " bytes) has CRC-32 " +
                hex32(seen) + (r.crc32_at ? ", its data descriptor says " : ", its zip directory says ") + hex32(r.crc32) +
                ": the file is corrupt or changed during the merge")
        .file(paths_[r.file])
        .tensor(r.tensor)
        .offset(r.offset);
}

void RecordChecker::finish(const SourceFds& sources) {
  std::vector<uint8_t> buffer;
  for (size_t i = 0; i < records_.size(); ++i) {
    {
      State& s = states_[i];
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.checked || s.parts.empty()) continue;  // checked already, or never read
    }
    const RecordCheck& r = records_[i];
    buffer.resize(kGapReadBytes);
    for (const auto& [a, b] : claim(i, 0, r.size)) {
      uint32_t crc = 0;
      for (uint64_t pos = a; pos < b;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kGapReadBytes, b - pos));
        sources.read_unchecked(r.file, r.offset + pos, buffer.data(), n);
        crc = crc32_update(crc, buffer.data(), n);
        pos += n;
      }
      complete(i, a, crc);
    }
  }
}

uint64_t RecordChecker::records_checked() const {
  uint64_t n = 0;
  for (size_t i = 0; i < records_.size(); ++i) {
    std::lock_guard<std::mutex> lock(states_[i].mutex);
    n += states_[i].checked;
  }
  return n;
}

}  // namespace shardmerge
