// MergePlan: a merge described as data. Every output tensor is a list of strided source
// regions (Slices) that tile it exactly once, plus the ops to apply (dtype cast, LoRA fold).
// Layout readers produce it; executors run it. It can be written as a plan file and read back
// (plan/plan_file.hpp) and tested without opening a file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// A source that is one compressed item inside a file (DCP's `stream.zstd` transform): the
// executor decodes bytes [offset, offset + length) of the file before reading, and slices and
// records address the decoded bytes. Planning decodes at most the head of an item.
struct CompressedItem {
  std::string codec;          // "zstd"
  uint64_t offset = 0;        // of the compressed bytes in the file
  uint64_t length = 0;        // compressed bytes
  // How many leading decoded bytes the slices and records need; the frame must decode to at
  // least that many.
  uint64_t decoded_size = 0;
  bool operator==(const CompressedItem&) const = default;
};

// Which process can read a source: any (a shared filesystem), or one rank of a multi-process
// merge (node-local rank files).
constexpr int32_t kAnyOwner = -1;

struct SourceFile {
  SourceFile() = default;
  SourceFile(std::string path_, uint64_t size_, std::optional<FileStamp> planned_ = std::nullopt)
      : path(std::move(path_)), size(size_), planned(std::move(planned_)) {}

  std::string path;
  uint64_t size = 0;                 // size when planned; a file that changed since is refused
  std::optional<FileStamp> planned;  // the file when the layout read it (absent in plans made by hand)
  std::optional<CompressedItem> compressed;
  int32_t owner = kAnyOwner;
  bool operator==(const SourceFile&) const = default;
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
  // Set when planning could not read the CRC-32 (a compressed item's archive keeps it in a data
  // descriptor after the storage, which planning does not decode): the executor reads it, a
  // little-endian u32, at this offset of the (decoded) source; `crc32` is then 0.
  std::optional<uint64_t> crc32_at = std::nullopt;
  bool operator==(const RecordCheck&) const = default;
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
  bool operator==(const Slice&) const = default;
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
  bool operator==(const LoraFold&) const = default;
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
  bool operator==(const OutputTensor&) const = default;
};

struct OutputFile {
  std::string name;    // relative to the output directory
  std::string header;  // bytes written at offset 0 (the safetensors header)
  uint64_t size = 0;   // total file size
  bool operator==(const OutputFile&) const = default;
};

// A file written beside the weights: copied from `source`, or `content` when set.
struct Sidecar {
  std::string name;
  std::string source;
  std::optional<std::string> content;
  bool operator==(const Sidecar&) const = default;
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
  bool operator==(const MergePlan&) const = default;
};


}  // namespace shardmerge
