// safetensors, validated as strictly as the reference implementation (huggingface/safetensors
// `Metadata::validate`): header length, UTF-8 JSON of the expected shape, known dtype names,
// offsets sorted, contiguous from 0, without holes or overlaps, sizes matching shapes, and a
// byte buffer that ends exactly at the end of the file. Duplicate names are refused too.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardmerge/dtype.hpp"

namespace shardmerge {

constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t file_offset = 0;  // absolute offset of the first data byte
  uint64_t nbytes = 0;
};

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  // Validates a header as found in a file of `file_size` bytes (exposed for tests and fuzzing).
  static SafetensorsFile from_header(std::string_view header_json, uint64_t file_size);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // in data order
  const SafetensorsTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// What a writer needs to know of a tensor before its bytes exist.
struct TensorDecl {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t nbytes() const;
};

// The byte layout of a safetensors file: the serialized header (length prefix included) and
// where each tensor's bytes go. Tensors are ordered as the reference writer orders them
// (dtype alignment descending, then name), so every tensor is naturally aligned.
struct SafetensorsLayout {
  std::string header;                     // 8-byte length + JSON padded with spaces to 8 bytes
  std::vector<SafetensorsTensor> tensors;  // layout order, absolute file offsets
  std::vector<size_t> order;               // tensors[k] is the given tensors[order[k]]
  uint64_t file_size = 0;
};

SafetensorsLayout layout_safetensors(const std::vector<TensorDecl>& tensors,
                                     const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes a whole small file from in-memory tensors (adapters, test data). `data[i]` holds
// the bytes of `tensors[i]`.
void write_safetensors(const std::string& path, const std::vector<TensorDecl>& tensors,
                       const std::vector<std::string>& data,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace shardmerge
