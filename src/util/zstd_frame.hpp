// Decoding of one zstd frame stored inside a file (torch DCP's stream.zstd transform writes one
// frame per item), streamed through fixed-size buffers: memory stays bounded whatever the
// item's size, and a reader can stop after the bytes it needs.
#pragma once

#include <zstd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shardmerge/error.hpp"
#include "util/file.hpp"

namespace shardmerge {

// Streams the decoded bytes of the zstd frame at [offset, offset + length) of `in`, in order.
// Refuses (Errors naming `in` and `offset`) a range that does not start with the zstd magic,
// a corrupt or truncated frame, a failed content checksum, and bytes after the frame within
// the range.
class ZstdFrameReader {
 public:
  ZstdFrameReader(const File& in, uint64_t offset, uint64_t length);

  // Decodes up to `n` (> 0) more bytes into `buf` and returns how many; 0 only once the whole
  // frame is decoded and checked.
  size_t read(char* buf, size_t n);
  uint64_t decoded() const { return decoded_; }  // bytes returned so far
  // The content size the frame header declares (torch's frames declare none).
  std::optional<uint64_t> declared_size() const { return declared_; }
  // An Error about this item.
  Error fail(const std::string& what) const;

 private:
  void refill();

  const File& in_;
  uint64_t offset_, length_;
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> ctx_;
  std::string inbuf_;
  ZSTD_inBuffer src_{nullptr, 0, 0};
  uint64_t consumed_ = 0;  // compressed bytes read from the file
  uint64_t decoded_ = 0;
  size_t last_ = 1;        // what ZSTD_decompressStream last returned: 0 once the frame is complete
  std::optional<uint64_t> declared_;
};

// How many decoded bytes past the ones a plan needs a compressed item may hold: a DCP item is
// a torch.save archive, whose records after the storage and central directory take about 1 kB.
// More is not a DCP item; the bound keeps a small frame from decoding for ever.
constexpr uint64_t kMaxDiscardedTail = 1 << 20;

// Decodes the whole zstd frame at [offset, offset + length) of `in` and writes its first
// `decoded_size` bytes to `out`, from its byte 0, discarding the rest. Refuses what
// ZstdFrameReader refuses, and a frame that decodes (or declares it decodes) to fewer than
// `decoded_size` bytes or to more than `decoded_size` + kMaxDiscardedTail.
void decode_zstd_frame(const File& in, uint64_t offset, uint64_t length, uint64_t decoded_size, const File& out);

}  // namespace shardmerge
