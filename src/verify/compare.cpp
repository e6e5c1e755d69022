#include "verify/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "exec/convert_cpu.hpp"
#include "plan/sharding.hpp"
#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {

void TensorDiff::merge(const TensorDiff& o) {
  elements += o.elements;
  mismatched += o.mismatched;
  max_abs_error = std::max(max_abs_error, o.max_abs_error);
}

namespace {

double as_double(const uint8_t* p, DType t) {
  if (t == DType::F64) {
    double d;
    std::memcpy(&d, p, 8);
    return d;
  }
  float f;
  convert_elements(p, t, 1, &f, DType::F32, 1);
  return f;
}

bool convertible_float(DType t) { return can_convert(t, DType::F32) && is_floating(t); }

}  // namespace

TensorDiff compare_elements(const uint8_t* a, const uint8_t* b, DType dtype, size_t n, double atol) {
  TensorDiff d;
  d.elements = n;
  const size_t es = dtype_size(dtype);
  if (std::memcmp(a, b, n * es) == 0) return d;
  const bool floating = convertible_float(dtype);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* x = a + i * es;
    const uint8_t* y = b + i * es;
    if (std::memcmp(x, y, es) == 0) continue;
    if (!floating) {
      ++d.mismatched;
      continue;
    }
    const double u = as_double(x, dtype), v = as_double(y, dtype);
    if (std::isnan(u) && std::isnan(v)) continue;
    const double err = std::fabs(u - v);
    // Bitwise means bitwise: +0 and -0 differ (only NaN payloads are forgiven).
    if (std::isnan(err) || err > atol || atol == 0) ++d.mismatched;
    if (!std::isnan(err)) d.max_abs_error = std::max(d.max_abs_error, err);
    else d.max_abs_error = INFINITY;
  }
  return d;
}

bool TreeDiff::equal() const {
  if (!missing.empty() || !unexpected.empty() || !mismatched_meta.empty()) return false;
  for (const auto& [_, v] : values)
    if (v.mismatched) return false;
  return true;
}

std::vector<std::string> TreeDiff::report(size_t max_lines) const {
  std::vector<std::string> lines;
  auto add = [&](const std::string& s) {
    if (lines.size() < max_lines) lines.push_back(s);
  };
  for (const auto& n : missing) add("missing: " + n);
  for (const auto& n : unexpected) add("unexpected: " + n);
  for (const auto& n : mismatched_meta) add("differs: " + n);
  for (const auto& [name, v] : values)
    if (v.mismatched)
      add("values differ: " + name + ": " + std::to_string(v.mismatched) + " of " + std::to_string(v.elements) +
          " elements, max abs error " + std::to_string(v.max_abs_error));
  return lines;
}

// ---- CompareSink -------------------------------------------------------------------------

CompareSink::CompareSink(const MergePlan& plan, const HfWeights& reference, double atol)
    : plan_(plan), reference_(reference), atol_(atol), by_file_(plan.files.size()) {
  for (const auto& f : reference.files) ref_files_.push_back(File::open_read(f.path()));
  for (const OutputTensor& t : plan.tensors) {
    Target target{t.offset, t.nbytes, t.name, t.dtype, nullptr};
    auto it = reference.tensors.find(t.name);
    if (it != reference.tensors.end() && it->second.tensor->dtype == t.dtype && it->second.tensor->shape == t.shape)
      target.ref = &it->second;
    by_file_[t.file].push_back(target);
  }
  for (auto& targets : by_file_)
    std::sort(targets.begin(), targets.end(), [](const Target& a, const Target& b) { return a.offset < b.offset; });
}

TreeDiff CompareSink::check_metadata() const {
  TreeDiff d;
  std::map<std::string, const OutputTensor*> planned;
  for (const auto& t : plan_.tensors)
    if (plan_.files[t.file].name.find('/') == std::string::npos) planned[t.name] = &t;  // model files only
  for (const auto& [name, t] : planned) {
    auto it = reference_.tensors.find(name);
    if (it == reference_.tensors.end()) {
      d.missing.push_back(name);
      continue;
    }
    const SafetensorsTensor& r = *it->second.tensor;
    if (r.dtype != t->dtype || r.shape != t->shape)
      d.mismatched_meta.push_back(name + ": merge gives " + std::string(dtype_name(t->dtype)) + " " + shape_string(t->shape) +
                                  ", reference has " + std::string(dtype_name(r.dtype)) + " " + shape_string(r.shape));
  }
  for (const auto& [name, _] : reference_.tensors)
    if (!planned.count(name)) d.unexpected.push_back(name);
  return d;
}

void CompareSink::write(uint32_t file, uint64_t offset, const void* data, size_t n) const {
  const auto& targets = by_file_.at(file);
  const auto* bytes = static_cast<const uint8_t*>(data);
  thread_local std::vector<uint8_t> ref;
  while (n > 0) {
    // The planned tensor that holds `offset`.
    auto it = std::upper_bound(targets.begin(), targets.end(), offset,
                               [](uint64_t off, const Target& t) { return off < t.offset; });
    if (it == targets.begin()) throw Error("internal: write outside any planned tensor");
    const Target& t = *(it - 1);
    const uint64_t within = offset - t.offset;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(n, t.nbytes - within));
    if (t.ref) {
      ref.resize(len);
      ref_files_[t.ref->file].read_exact(t.ref->tensor->file_offset + within, ref.data(), len);
      const size_t es = dtype_size(t.dtype);
      TensorDiff d = compare_elements(bytes, ref.data(), t.dtype, len / es, atol_);
      std::lock_guard<std::mutex> lock(mutex_);
      values_[t.name].merge(d);
    }
    bytes += len;
    offset += len;
    n -= len;
  }
}

TreeDiff CompareSink::result() const {
  TreeDiff d = check_metadata();
  std::lock_guard<std::mutex> lock(mutex_);
  d.values = values_;
  return d;
}

// ---- diff ----------------------------------------------------------------------------------

TreeDiff diff_trees(const HfWeights& a, const HfWeights& b, double atol) {
  TreeDiff d;
  std::vector<File> fa, fb;
  for (const auto& f : a.files) fa.push_back(File::open_read(f.path()));
  for (const auto& f : b.files) fb.push_back(File::open_read(f.path()));
  constexpr size_t kChunk = 16u << 20;
  std::vector<uint8_t> ba(kChunk), bb(kChunk);
  for (const auto& [name, ra] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) {
      d.missing.push_back(name);
      continue;
    }
    const SafetensorsTensor& ta = *ra.tensor;
    const SafetensorsTensor& tb = *it->second.tensor;
    if (ta.dtype != tb.dtype || ta.shape != tb.shape) {
      d.mismatched_meta.push_back(name + ": " + std::string(dtype_name(ta.dtype)) + " " + shape_string(ta.shape) + " vs " +
                                  std::string(dtype_name(tb.dtype)) + " " + shape_string(tb.shape));
      continue;
    }
    const size_t es = dtype_size(ta.dtype);
    const size_t chunk = kChunk / es * es;
    TensorDiff total;
    for (uint64_t pos = 0; pos < ta.nbytes; pos += chunk) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(chunk, ta.nbytes - pos));
      fa[ra.file].read_exact(ta.file_offset + pos, ba.data(), len);
      fb[it->second.file].read_exact(tb.file_offset + pos, bb.data(), len);
      total.merge(compare_elements(ba.data(), bb.data(), ta.dtype, len / es, atol));
    }
    d.values[name] = total;
  }
  for (const auto& [name, _] : b.tensors)
    if (!a.tensors.count(name)) d.unexpected.push_back(name);
  return d;
}

}  // namespace shardmerge
