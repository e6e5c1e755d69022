#include <nlohmann/json.hpp>

#include "plan/sharding.hpp"
#include "shardmerge/plan.hpp"
#include "util/shape.hpp"

namespace shardmerge {

uint64_t Slice::numel() const { return element_count(extent); }

bool Slice::source_contiguous() const {
  int64_t expected = 1;
  for (size_t i = extent.size(); i-- > 0;) {
    if (extent[i] != 1 && strides[i] != expected) return false;
    expected *= extent[i];
  }
  return true;
}

std::optional<Slice> intersect(const Slice& s, const std::vector<int64_t>& start, const std::vector<int64_t>& extent) {
  Slice out = s;
  const uint64_t elem = dtype_size(s.dtype);
  for (size_t d = 0; d < s.start.size(); ++d) {
    const int64_t lo = std::max(s.start[d], start[d]);
    const int64_t hi = std::min(s.start[d] + s.extent[d], start[d] + extent[d]);
    if (lo >= hi) return std::nullopt;
    out.offset += static_cast<uint64_t>((lo - s.start[d]) * s.strides[d]) * elem;
    out.start[d] = lo;
    out.extent[d] = hi - lo;
  }
  return out;
}

uint64_t OutputTensor::numel() const { return element_count(shape); }

uint64_t MergePlan::bytes_read() const {
  uint64_t n = 0;
  auto add = [&](const std::vector<Slice>& slices) {
    for (const auto& s : slices) n += s.numel() * dtype_size(s.dtype);
  };
  for (const auto& t : tensors) {
    add(t.copies);
    if (t.lora) {
      add(t.lora->a);
      add(t.lora->b);
    }
  }
  return n;
}

uint64_t MergePlan::bytes_written() const {
  uint64_t n = 0;
  for (const auto& f : files) n += f.size;
  return n;
}

namespace {

nlohmann::ordered_json slice_json(const MergePlan& plan, const Slice& s) {
  nlohmann::ordered_json j;
  j["file"] = plan.sources.at(s.file).path;
  j["offset"] = s.offset;
  j["length"] = s.numel() * dtype_size(s.dtype);
  j["dtype"] = dtype_name(s.dtype);
  j["strides"] = s.strides;
  j["dst_start"] = s.start;
  j["dst_extent"] = s.extent;
  return j;
}

}  // namespace

nlohmann::ordered_json to_json(const MergePlan& plan) {
  nlohmann::ordered_json j;
  j["source_dir"] = plan.source_dir;
  j["layout"] = plan.layout;
  j["bytes_read"] = plan.bytes_read();
  j["bytes_written"] = plan.bytes_written();
  j["notes"] = plan.notes;
  j["warnings"] = plan.warnings;
  auto& files = j["files"] = nlohmann::ordered_json::array();
  for (const auto& f : plan.files) files.push_back({{"name", f.name}, {"size", f.size}, {"header_bytes", f.header.size()}});
  auto& tensors = j["tensors"] = nlohmann::ordered_json::array();
  for (const auto& t : plan.tensors) {
    nlohmann::ordered_json tj;
    tj["name"] = t.name;
    tj["dtype"] = dtype_name(t.dtype);
    tj["shape"] = t.shape;
    tj["file"] = plan.files.at(t.file).name;
    tj["offset"] = t.offset;
    tj["nbytes"] = t.nbytes;
    tj["origin"] = t.origin;
    auto& ops = tj["ops"] = nlohmann::ordered_json::array();
    std::vector<DType> casts;
    for (const auto& s : t.copies)
      if (s.dtype != t.dtype && std::find(casts.begin(), casts.end(), s.dtype) == casts.end()) casts.push_back(s.dtype);
    for (DType from : casts)
      ops.push_back({{"op", "cast"}, {"from", dtype_name(from)}, {"to", dtype_name(t.dtype)}});
    if (t.lora) {
      nlohmann::ordered_json fold = {{"op", "lora_fold"},
                                     {"rank", t.lora->rank},
                                     {"scale", t.lora->scale},
                                     {"fan_in_fan_out", t.lora->fan_in_fan_out}};
      for (const auto& s : t.lora->a) fold["a"].push_back(slice_json(plan, s));
      for (const auto& s : t.lora->b) fold["b"].push_back(slice_json(plan, s));
      ops.push_back(std::move(fold));
    }
    auto& copies = tj["copies"] = nlohmann::ordered_json::array();
    for (const auto& s : t.copies) copies.push_back(slice_json(plan, s));
    tensors.push_back(std::move(tj));
  }
  auto& records = j["records"] = nlohmann::ordered_json::array();
  for (const auto& r : plan.records)
    records.push_back({{"file", plan.sources.at(r.file).path},
                       {"record", r.record},
                       {"tensor", r.tensor},
                       {"offset", r.offset},
                       {"size", r.size},
                       {"crc32", r.crc32}});
  auto& side = j["sidecars"] = nlohmann::ordered_json::array();
  for (const auto& s : plan.sidecars)
    side.push_back({{"name", s.name}, {"from", s.content ? std::string("(generated)") : s.source}});
  return j;
}

}  // namespace shardmerge
