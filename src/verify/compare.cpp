#include "verify/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "exec/convert_cpu.hpp"
#include "geometry/sharding.hpp"
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
  if (!missing.empty() || !unexpected.empty() || !mismatched_meta.empty() || !not_covered.empty()) return false;
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
  for (const auto& n : not_covered) add("not covered exactly once: " + n);
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

namespace {

// Every element of one tensor in both trees, `chunk_elements` at a time (ba and bb hold that
// many of either side): `compare(n)` compares the raw bytes of the same n elements of each side.
template <typename Compare>
TensorDiff stream_pair(const File& fa, const SafetensorsTensor& ta, const File& fb, const SafetensorsTensor& tb,
                       size_t chunk_elements, std::vector<uint8_t>& ba, std::vector<uint8_t>& bb, Compare compare) {
  const size_t esa = dtype_size(ta.dtype), esb = dtype_size(tb.dtype);
  const uint64_t elements = ta.nbytes / esa;
  TensorDiff total;
  for (uint64_t pos = 0; pos < elements; pos += chunk_elements) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_elements, elements - pos));
    fa.read_exact(ta.file_offset + pos * esa, ba.data(), n * esa);
    fb.read_exact(tb.file_offset + pos * esb, bb.data(), n * esb);
    total.merge(compare(n));
  }
  return total;
}

}  // namespace

TreeDiff diff_trees(const HfWeights& a, const HfWeights& b, double atol) {
  TreeDiff d;
  std::vector<File> fa, fb;
  for (const auto& f : a.files) fa.push_back(File::open_read(f.path()));
  for (const auto& f : b.files) fb.push_back(File::open_read(f.path()));
  constexpr size_t kChunk = 16u << 20;
  std::vector<uint8_t> ba(kChunk), bb(kChunk);
  constexpr size_t kFp32Chunk = kChunk / 8;  // elements: fits ba and bb for every dtype up to 8 bytes
  std::vector<float> va, vb;                  // both sides as fp32, when their dtypes differ
  for (const auto& [name, ra] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) {
      d.missing.push_back(name);
      continue;
    }
    const SafetensorsTensor& ta = *ra.tensor;
    const SafetensorsTensor& tb = *it->second.tensor;
    const File& file_a = fa[ra.file];
    const File& file_b = fb[it->second.file];
    const bool floats = convertible_float(ta.dtype) && convertible_float(tb.dtype);
    if (ta.shape != tb.shape || (ta.dtype != tb.dtype && !(floats && atol > 0))) {
      // A tolerance makes values, not encodings, the question: with one, floats of different
      // dtypes are compared as fp32 below.
      const bool hint = ta.shape == tb.shape && floats;
      d.mismatched_meta.push_back(name + ": " + std::string(dtype_name(ta.dtype)) + " " + shape_string(ta.shape) + " vs " +
                                  std::string(dtype_name(tb.dtype)) + " " + shape_string(tb.shape) +
                                  (hint ? " (with --atol the values are compared as fp32)" : ""));
      continue;
    }
    if (ta.dtype == tb.dtype) {
      d.values[name] = stream_pair(file_a, ta, file_b, tb, kChunk / dtype_size(ta.dtype), ba, bb, [&](size_t n) {
        return compare_elements(ba.data(), bb.data(), ta.dtype, n, atol);
      });
      continue;
    }
    d.compared_as_fp32.push_back(name + ": " + std::string(dtype_name(ta.dtype)) + " vs " +
                                 std::string(dtype_name(tb.dtype)));
    va.resize(kFp32Chunk);
    vb.resize(kFp32Chunk);
    d.values[name] = stream_pair(file_a, ta, file_b, tb, kFp32Chunk, ba, bb, [&](size_t n) {
      convert_elements(ba.data(), ta.dtype, 1, va.data(), DType::F32, n);
      convert_elements(bb.data(), tb.dtype, 1, vb.data(), DType::F32, n);
      return compare_elements(reinterpret_cast<const uint8_t*>(va.data()), reinterpret_cast<const uint8_t*>(vb.data()),
                              DType::F32, n, atol);
    });
  }
  for (const auto& [name, _] : b.tensors)
    if (!a.tensors.count(name)) d.unexpected.push_back(name);
  return d;
}

}  // namespace shardmerge
