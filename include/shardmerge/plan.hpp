// MergePlan: a merge described as data. Every output tensor is a list of strided source
// regions (Slices) that tile it exactly once, plus the ops to apply (dtype cast, LoRA fold).
// Layout readers produce it; executors run it. It can be printed as JSON and tested without
// opening a file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shardmerge/dtype.hpp"

namespace shardmerge {

// What fstat said about a file when it was read: a source whose stamp differs later was
// changed or replaced in between (content, not only size).
struct FileStamp {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  uint64_t inode = 0;
  uint64_t device = 0;
  bool operator==(const FileStamp&) const = default;
};

struct SourceFile {
  std::string path;
  uint64_t size = 0;                 // size when planned; a file that changed since is refused
  std::optional<FileStamp> planned;  // the file when the layout read it (absent in plans made by hand)
};

// A zip record (a torch.save storage) that slices read, with the CRC-32 its central directory
// gives. Executors check the CRC of every record they read any byte of, over the whole record.
struct RecordCheck {
  uint32_t file = 0;    // index into MergePlan::sources
  uint64_t offset = 0;  // absolute offset of the record's first data byte
  uint64_t size = 0;
  uint32_t crc32 = 0;
  std::string record;   // the zip entry, e.g. "archive/data/3"
  std::string tensor;   // a tensor whose bytes it holds, as the checkpoint names it
};

// A strided region of one source file, placed at box [start, start + extent) of a tensor.
// Element (i0, i1, ...) of the box is at byte offset + sum(i_k * strides[k]) * sizeof(dtype).
struct Slice {
  uint32_t file = 0;
  uint64_t offset = 0;
  DType dtype = DType::F32;
  std::vector<int64_t> strides;  // in elements of `dtype`
  std::vector<int64_t> start;
  std::vector<int64_t> extent;

  uint64_t numel() const;
  // True when the region is one run of bytes in the file (row-major dense over `extent`).
  bool source_contiguous() const;
};

// The part of `s` that falls inside the box [start, start + extent), or nothing.
std::optional<Slice> intersect(const Slice& s, const std::vector<int64_t>& start, const std::vector<int64_t>& extent);

// W' = W + scale * (B @ A) in fp32, then one cast to the output dtype. A is [r, in] and B is
// [out, r]; with fan_in_fan_out the base weight is stored transposed ([in, out]).
struct LoraFold {
  std::vector<Slice> a;  // tiles A, shape [r, in]
  std::vector<Slice> b;  // tiles B, shape [out, r]
  int64_t rank = 0;
  double scale = 0;
  bool fan_in_fan_out = false;
};

struct OutputTensor {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  uint32_t file = 0;     // index into MergePlan::files
  uint64_t offset = 0;   // absolute byte offset in that file
  uint64_t nbytes = 0;
  std::vector<Slice> copies;  // tile `shape` exactly once
  std::optional<LoraFold> lora;
  std::string origin;    // how the source held it, e.g. "Shard(0) x4 ranks"

  uint64_t numel() const;
};

struct OutputFile {
  std::string name;    // relative to the output directory
  std::string header;  // bytes written at offset 0 (the safetensors header)
  uint64_t size = 0;   // total file size
};

// A file written beside the weights: copied from `source`, or `content` when set.
struct Sidecar {
  std::string name;
  std::string source;
  std::optional<std::string> content;
};

struct MergePlan {
  std::string source_dir;
  std::string layout;                 // e.g. "fsdp2 world_size=4 mesh=(fsdp)"
  std::vector<SourceFile> sources;
  std::vector<RecordCheck> records;   // by file and offset, one per record; safetensors sources have none
  std::vector<OutputFile> files;
  std::vector<OutputTensor> tensors;  // in output order
  std::vector<Sidecar> sidecars;
  std::vector<std::string> notes;     // decisions a user should know about
  std::vector<std::string> warnings;  // choices that lose information, printed on stderr (e.g. a bf16 <-> fp16 cast)

  uint64_t bytes_read() const;     // sum of the source bytes the copies touch
  uint64_t bytes_written() const;  // sum of output file sizes
};

nlohmann::ordered_json to_json(const MergePlan& plan);

}  // namespace shardmerge
