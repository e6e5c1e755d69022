// PyTorch Distributed Checkpoint (DCP) directories, as Megatron's torch_dist backend writes
// them: `.metadata` (a pickle of torch.distributed.checkpoint.metadata.Metadata) and
// `__<rank>_<n>.distcp` files whose items are whole torch.save archives, one per tensor
// chunk, at the offsets `.metadata` gives. Items may be zstd-compressed (`stream.zstd/1`):
// planning decodes only the head of their archive (formats/torch_item_head.hpp), the executor
// the rest; verify decodes them, streaming, into a scratch file that it owns.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"
#include "shardmerge/dtype.hpp"

namespace shardmerge {

struct DcpChunk {
  std::vector<int64_t> offsets;  // box of the global tensor this chunk holds
  std::vector<int64_t> sizes;
  std::string relative_path;     // the .distcp file
  uint64_t offset = 0;           // item position and length in that file
  uint64_t length = 0;
  std::vector<std::string> transforms;  // e.g. {"stream.zstd/1"}; empty when stored as is
};

struct DcpTensor {
  std::string fqn;
  DType dtype = DType::F32;
  std::vector<int64_t> size;  // global shape
  std::vector<DcpChunk> chunks;
};

struct DcpMetadata {
  std::string dir;
  std::vector<DcpTensor> tensors;        // TensorStorageMetadata entries, in .metadata order
  std::vector<std::string> bytes_items;  // BytesStorageMetadata keys (extra states, rng, ...)
  // Megatron's mcore_data: fqn -> nd_reformulated_orig_global_shape, for flattened tensors.
  std::map<std::string, std::vector<int64_t>> reformulated_shapes;
};

DcpMetadata read_dcp_metadata(const std::string& dir);
// The same from the bytes of a `.metadata` file; `dir` is only recorded.
DcpMetadata parse_dcp_metadata(std::string_view data, const std::string& dir);

// Where one chunk's elements are: a strided view into a storage record of some file.
struct DcpChunkData {
  std::string path;               // file holding the storage bytes (the .distcp, or a scratch file)
  FileStamp stamp;                // of that file, when it was opened
  ZipEntry record;                // the storage record (absolute offsets in `path`)
  TensorView view;                // the chunk tensor (sizes == chunk.sizes, with leading singleton dims)
  // For the head of a compressed item whose storage CRC-32 follows the storage bytes (torch
  // writes it in a data descriptor), which planning does not decode: where it is in the decoded
  // bytes; record.crc32 is then 0.
  std::optional<uint64_t> record_crc32_at = std::nullopt;
};

// How an item is stored; throws for a transform shardmerge does not know.
enum class DcpItemCoding { Stored, Zstd };
DcpItemCoding item_coding(const DcpChunk& chunk);

// Throws when the chunk's item does not lie within a file of `file_size` bytes.
void check_item_within(const DcpChunk& chunk, uint64_t file_size);

// Parses the torch.save archive embedded at the chunk's item. Transformed items are first
// decoded into `scratch_dir` (created if needed).
DcpChunkData locate_dcp_chunk(const DcpMetadata& meta, const DcpTensor& tensor, const DcpChunk& chunk,
                              const std::string& scratch_dir);
// The same without decoding any tensor bytes, for planning: a stored item is read in place, a
// zstd-compressed one from the head of its decoded archive only (`path` and `stamp` are then
// the .distcp's, record offsets are in decoded bytes).
DcpChunkData locate_dcp_chunk_head(const DcpMetadata& meta, const DcpTensor& tensor, const DcpChunk& chunk);

}  // namespace shardmerge
