// The head of a torch.save archive that holds one tensor (a DCP item), read from the start of
// its bytes as they stream in: the leading local file headers, in order, up to the storage
// record's header. What a compressed item is needed for at planning time, without decoding
// its tensor bytes (the executor decodes those).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>

#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"

namespace shardmerge {

// The leading records of an archive must lie within this many bytes: torch writes data.pkl
// (a few hundred bytes) and three tiny records before the storage.
constexpr uint64_t kMaxItemHeadBytes = 1 << 20;

struct TorchItemHead {
  TensorView view;   // the one plain tensor its data.pkl holds
  ZipEntry storage;  // its storage record: name, data offset (from the archive's byte 0), size
  // torch leaves a record's CRC-32 to a data descriptor after its data, past the head: then
  // storage.crc32 is unknown (0), and this is where the CRC-32 is (after the descriptor's
  // signature, which torch writes).
  std::optional<uint64_t> crc32_at;
};

// Writes up to `n` more bytes of the archive into `buf` and returns how many; 0 at its end.
using PullBytes = std::function<size_t(char* buf, size_t n)>;

// Reads the head strictly: every record is "<archive>/..." for the archive name of the first,
// which is data.pkl; records are stored (not compressed), with no flags but a data descriptor
// and UTF-8 names; records before the storage are read whole and CRC-checked (against their
// local header or their data descriptor); byteorder, if there, is "little". Pulls no byte past
// the storage record's local header, and none past `max_bytes`. Errors name decoded offsets;
// the caller adds the file.
TorchItemHead read_torch_item_head(const PullBytes& pull, uint64_t max_bytes = kMaxItemHeadBytes);

}  // namespace shardmerge
