#include "formats/torch_item_head.hpp"

#include <optional>
#include <string>
#include <variant>

#include "shardmerge/error.hpp"
#include "util/bytes.hpp"
#include "util/crc32.hpp"

namespace shardmerge {
namespace {

constexpr uint16_t kUtf8NameFlag = 0x0800;
constexpr size_t kLocalHeaderSize = 30;

struct LocalRecord {
  std::string name;
  uint64_t header_offset = 0;
  uint64_t data_offset = 0;
  bool descriptor = false;  // CRC and size follow the data
  bool zip64 = false;       // then the descriptor's sizes are 8 bytes each
  uint64_t size = 0;        // without a descriptor
  uint32_t crc32 = 0;
};

// The archive's bytes read so far, pulled on demand and never past `max`.
class Prefix {
 public:
  Prefix(const PullBytes& pull, uint64_t max) : pull_(pull), max_(max) {}

  // Makes bytes [0, end) available; throws when the archive ends before, or `end` is past the bound.
  void ensure(uint64_t end, const std::string& what) {
    if (end > max_)
      throw Error("torch.save item: " + what + " does not lie within its first " + std::to_string(max_) + " decoded bytes");
    while (bytes_.size() < end) {
      const size_t have = bytes_.size();
      bytes_.resize(static_cast<size_t>(end));
      const size_t n = pull_(bytes_.data() + have, static_cast<size_t>(end - have));
      bytes_.resize(have + n);
      if (n == 0)
        throw Error("torch.save item: truncated: it ends after " + std::to_string(have) + " bytes, inside " + what);
    }
  }
  const char* at(uint64_t pos) const { return bytes_.data() + pos; }

 private:
  const PullBytes& pull_;
  uint64_t max_;
  std::string bytes_;
};

LocalRecord read_local_header(Prefix& p, uint64_t pos) {
  const std::string where = "the local header at decoded byte " + std::to_string(pos);
  p.ensure(pos + kLocalHeaderSize, where);
  const char* h = p.at(pos);
  if (load_le<uint32_t>(h) != kLocalHeaderSig)
    throw Error("torch.save item: no zip local header at decoded byte " + std::to_string(pos));
  const uint16_t flags = load_le<uint16_t>(h + 6);
  const uint16_t method = load_le<uint16_t>(h + 8);
  LocalRecord r;
  r.header_offset = pos;
  r.crc32 = load_le<uint32_t>(h + 14);
  uint64_t csize = load_le<uint32_t>(h + 18);
  uint64_t usize = load_le<uint32_t>(h + 22);
  const uint16_t name_len = load_le<uint16_t>(h + 26);
  const uint16_t extra_len = load_le<uint16_t>(h + 28);
  r.data_offset = pos + kLocalHeaderSize + name_len + extra_len;
  p.ensure(r.data_offset, where);
  r.name.assign(p.at(pos + kLocalHeaderSize), name_len);
  const std::string_view extra(p.at(pos + kLocalHeaderSize + name_len), extra_len);
  const std::string bad = "torch.save item: record '" + r.name + "' (" + where + ") ";
  if (flags & ~(kDataDescriptorFlag | kUtf8NameFlag))
    throw Error(bad + "has flags " + std::to_string(flags) + " (encrypted, or not written by torch)");
  if (method != 0) throw Error(bad + "is compressed inside the zip (method " + std::to_string(method) + ")");
  r.descriptor = flags & kDataDescriptorFlag;
  r.zip64 = extra_field(extra, 0x0001).has_value();
  if (r.descriptor) {
    if (r.crc32 != 0 || csize != 0 || usize != 0)
      throw Error(bad + "leaves its CRC-32 and size to a data descriptor but also gives them");
    return r;
  }
  uint64_t unused_lho = 0;
  apply_zip64_extra(extra, usize, csize, unused_lho, r.name);
  if (csize != usize) throw Error(bad + "says " + std::to_string(csize) + " bytes stored of " + std::to_string(usize));
  r.size = usize;
  return r;
}

// The data of `r`, checked against its CRC-32, and where the next record starts.
std::pair<std::string, uint64_t> read_record(Prefix& p, const LocalRecord& r) {
  const std::string what = "record '" + r.name + "'";
  if (!r.descriptor) {
    p.ensure(r.data_offset + r.size, what);
    std::string data(p.at(r.data_offset), static_cast<size_t>(r.size));
    if (crc32_update(0, data.data(), data.size()) != r.crc32)
      throw Error("torch.save item: CRC-32 mismatch in record '" + r.name + "'");
    return {std::move(data), r.data_offset + r.size};
  }
  // The data runs to the first descriptor that gives its size and CRC-32.
  const uint64_t descriptor_size = r.zip64 ? 24 : 16;
  for (uint64_t end = r.data_offset;; ++end) {
    p.ensure(end + descriptor_size, what + " and its data descriptor");
    const char* d = p.at(end);
    if (load_le<uint32_t>(d) != kDataDescriptorSig) continue;
    const uint64_t size = end - r.data_offset;
    const uint64_t csize = r.zip64 ? load_le<uint64_t>(d + 8) : load_le<uint32_t>(d + 8);
    const uint64_t usize = r.zip64 ? load_le<uint64_t>(d + 16) : load_le<uint32_t>(d + 12);
    if (csize != size || usize != size) continue;
    std::string data(p.at(r.data_offset), static_cast<size_t>(size));
    if (crc32_update(0, data.data(), data.size()) == load_le<uint32_t>(d + 4)) return {std::move(data), end + descriptor_size};
  }
}

}  // namespace

TorchItemHead read_torch_item_head(const PullBytes& pull, uint64_t max_bytes) {
  Prefix p(pull, max_bytes);
  const LocalRecord pkl = read_local_header(p, 0);
  const auto slash = pkl.name.find('/');
  if (slash == std::string::npos || slash == 0 || pkl.name.substr(slash) != "/data.pkl")
    throw Error("torch.save item: its first record is '" + pkl.name + "', not '<archive>/data.pkl'");
  const std::string archive = pkl.name.substr(0, slash + 1);
  auto [pickle, next] = read_record(p, pkl);

  TorchItemHead head;
  const pickle::Document doc = parse_torch_pickle(pickle);
  const std::vector<StateEntry> entries = collect_tensors(doc.root());
  if (entries.size() != 1 || !entries[0].is_plain()) throw Error("torch.save item: not a torch.save of one plain tensor");
  head.view = std::get<TensorView>(entries[0].value);
  const std::string storage = archive + "data/" + head.view.storage_key;
  while (true) {
    const LocalRecord r = read_local_header(p, next);
    if (r.name.compare(0, archive.size(), archive) != 0)
      throw Error("torch.save item: record '" + r.name + "' is outside '" + archive + "'");
    if (r.name == storage) {
      uint64_t end = 0;
      if (__builtin_add_overflow(r.data_offset, head.view.storage_nbytes, &end) || end > (uint64_t{1} << 62))
        throw Error("torch.save item: storage of " + std::to_string(head.view.storage_nbytes) + " bytes is larger than any file");
      if (!r.descriptor && r.size != head.view.storage_nbytes)
        throw Error("torch.save item: storage record '" + r.name + "' has " + std::to_string(r.size) +
                    " bytes, its pickle says " + std::to_string(head.view.storage_nbytes));
      head.storage = {r.name, r.data_offset, head.view.storage_nbytes, r.crc32};
      if (r.descriptor) head.crc32_at = r.data_offset + head.view.storage_nbytes + 4;
      return head;
    }
    std::string data;
    std::tie(data, next) = read_record(p, r);
    if (r.name == archive + "byteorder" && data != "little")
      throw Error("torch.save item: saved on a big-endian machine; only little-endian data is supported");
  }
}

}  // namespace shardmerge
