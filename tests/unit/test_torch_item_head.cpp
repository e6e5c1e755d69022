// The head of a DCP item's torch.save archive (formats/torch_item_head.cpp), read from a
// prefix of its bytes: what planning reads of a compressed item. Archives are written with the
// repository's torch writer (data descriptors, as torch's miniz writes them) and compressed here
// with libzstd; the oracle for offsets and sizes is the central-directory reader
// (formats/zip.cpp) on the whole, uncompressed archive.
#include <gtest/gtest.h>
#include <zstd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "formats/dcp.hpp"
#include "formats/pickle_writer.hpp"
#include "formats/torch_item_head.hpp"
#include "formats/torch_writer.hpp"
#include "formats/zip.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/bytes.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

// The pickle of torch.save(t) for a float32 [rows, cols] view of storage "0" (of `storage_n`
// elements) at element `offset`.
std::string tensor_pickle(int64_t storage_n, int64_t rows, int64_t cols, int64_t offset = 0) {
  pickle::Writer w;
  w.global("torch._utils", "_rebuild_tensor_v2").mark();
  w.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").integer(storage_n).tuple().binpersid();
  w.integer(offset).int_tuple({rows, cols}).int_tuple({cols, 1}).boolean(false);
  w.global("collections", "OrderedDict").empty_tuple().reduce();
  w.tuple().reduce();
  return w.finish();
}

struct Record {
  std::string name, data;
};

// A torch.save archive "item" of `records`, in that order, as bytes.
std::string archive(const TempDir& dir, const std::vector<Record>& records) {
  const std::string path = dir / "item.pt";
  std::filesystem::remove(path);
  {
    TorchArchiveWriter zip(path, "item");
    for (const Record& r : records) zip.add_record(r.name, r.data);
    zip.finish();
  }
  return test::read_file(path);
}

std::string storage_bytes(size_t n) {
  std::string s(n * 4, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 7 + 1);
  return s;
}

// torch's order: data.pkl, .format_version, .storage_alignment, byteorder, then the storage.
std::vector<Record> torch_records(int64_t rows, int64_t cols, int64_t storage_n, int64_t offset = 0) {
  return {{"data.pkl", tensor_pickle(storage_n, rows, cols, offset)},
          {".format_version", "1"},
          {".storage_alignment", "64"},
          {"byteorder", "little"},
          {"data/0", storage_bytes(static_cast<size_t>(storage_n))}};
}

// Reads the head from `bytes`, counting how many bytes it pulled.
TorchItemHead head_of(const std::string& bytes, uint64_t* pulled = nullptr, uint64_t max = kMaxItemHeadBytes) {
  uint64_t pos = 0;
  const TorchItemHead head = read_torch_item_head(
      [&](char* buf, size_t n) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(n, bytes.size() - pos));
        bytes.copy(buf, k, static_cast<size_t>(pos));
        pos += k;
        return k;
      },
      max);
  if (pulled) *pulled = pos;
  return head;
}

std::string head_error(const std::string& bytes, uint64_t max = kMaxItemHeadBytes) {
  try {
    head_of(bytes, nullptr, max);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "read";
  return "";
}

// Sets the 16-bit field at `field` of the local header of `record` (e.g. 8: method).
std::string with_local_field(std::string bytes, const std::string& record, size_t field, uint16_t value) {
  const size_t at = bytes.find("item/" + record) - 30;
  EXPECT_EQ(load_le<uint32_t>(bytes.data() + at), kLocalHeaderSig);
  bytes[at + field] = static_cast<char>(value & 0xff);
  bytes[at + field + 1] = static_cast<char>(value >> 8);
  return bytes;
}

TEST(TorchItemHead, FindsTheViewAndTheStorageRecordAsTheCentralDirectoryDoesWithoutReadingTheStorage) {
  TempDir dir;
  const std::string bytes = archive(dir, torch_records(6, 40, 300, 20));
  write_small_file(dir / "whole.pt", bytes, /*overwrite=*/true);
  const ZipArchive zip = ZipArchive::read(File::open_read(dir / "whole.pt"));
  const ZipEntry* oracle = zip.find("item/data/0");
  ASSERT_NE(oracle, nullptr);

  uint64_t pulled = 0;
  const TorchItemHead head = head_of(bytes, &pulled);
  EXPECT_EQ(head.view.size, (std::vector<int64_t>{6, 40}));
  EXPECT_EQ(head.view.stride, (std::vector<int64_t>{40, 1}));
  EXPECT_EQ(head.view.storage_offset, 20);
  EXPECT_EQ(head.storage.name, "item/data/0");
  EXPECT_EQ(head.storage.data_offset, oracle->data_offset);
  EXPECT_EQ(head.storage.size, oracle->size);
  // torch's CRC-32 is in the descriptor after the data, after its signature.
  EXPECT_EQ(head.storage.crc32, 0u);
  EXPECT_EQ(head.crc32_at, oracle->data_offset + oracle->size + 4);
  EXPECT_EQ(load_le<uint32_t>(bytes.data() + *head.crc32_at), oracle->crc32);
  EXPECT_EQ(pulled, head.storage.data_offset);
}

TEST(TorchItemHead, AStorageRecordWithoutADescriptorHasItsCrcInItsHeader) {
  // An empty storage: torch writes it with its (zero) size and CRC in the local header.
  TempDir dir;
  const TorchItemHead head = head_of(archive(dir, torch_records(0, 0, 0)));
  EXPECT_EQ(head.storage.size, 0u);
  EXPECT_FALSE(head.crc32_at);
}

TEST(TorchItemHead, ReadsTheHeadOfACompressedDcpItemAndChecksItAgainstTheMetadata) {
  TempDir dir;
  const std::string bytes = archive(dir, torch_records(6, 40, 240));
  write_small_file(dir / "whole.pt", bytes, /*overwrite=*/true);
  const ZipArchive zip = ZipArchive::read(File::open_read(dir / "whole.pt"));
  const ZipEntry* oracle = zip.find("item/data/0");
  ASSERT_NE(oracle, nullptr);
  std::string frame(ZSTD_compressBound(bytes.size()), '\0');
  frame.resize(ZSTD_compress(frame.data(), frame.size(), bytes.data(), bytes.size(), 3));
  const std::string before = "another item";
  write_small_file(dir / "__0_0.distcp", before + frame + "next", /*overwrite=*/true);

  DcpMetadata meta;
  meta.dir = dir.path().string();
  DcpTensor t{"w", DType::F32, {6, 40}, {}};
  DcpChunk c{{0, 0}, {6, 40}, "__0_0.distcp", before.size(), frame.size(), {"stream.zstd/1"}};
  const DcpChunkData data = locate_dcp_chunk_head(meta, t, c);
  EXPECT_EQ(data.path, dir / "__0_0.distcp");
  EXPECT_EQ(data.record.data_offset, oracle->data_offset);
  EXPECT_EQ(data.record.size, oracle->size);
  EXPECT_EQ(data.record_crc32_at, oracle->data_offset + oracle->size + 4);

  c.sizes = {6, 41};
  try {
    locate_dcp_chunk_head(meta, t, c);
    ADD_FAILURE() << "located";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("but .metadata says [6, 41]"), std::string::npos) << e.what();
  }
  // A flipped byte in the frame header: zstd refuses it, naming the file and the item.
  std::string broken = before + frame + "next";
  broken[before.size() + 4] = static_cast<char>(0xff);
  write_small_file(dir / "__0_0.distcp", broken, /*overwrite=*/true);
  c.sizes = {6, 40};
  try {
    locate_dcp_chunk_head(meta, t, c);
    ADD_FAILURE() << "located";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zstd item"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at byte " + std::to_string(before.size())), std::string::npos) << e.what();
  }
}

TEST(TorchItemHead, RefusesHostileHeads) {
  TempDir dir;
  const std::string good = archive(dir, torch_records(6, 40, 240));
  const uint64_t storage_at = head_of(good).storage.data_offset;
  auto refused = [&](const std::string& bytes, const std::string& why, uint64_t max = kMaxItemHeadBytes) {
    const std::string what = head_error(bytes, max);
    EXPECT_NE(what.find(why), std::string::npos) << what;
  };
  // Truncated: the archive ends inside data.pkl, or before the storage header is whole.
  refused(good.substr(0, 100), "truncated: it ends after 100 bytes");
  refused(good.substr(0, storage_at - 5), "truncated");
  // A wrong local header signature, first or later.
  std::string bad_sig = good;
  bad_sig[0] = 'Q';
  refused(bad_sig, "no zip local header at decoded byte 0");
  std::string bad_next = good;
  bad_next[good.find("item/byteorder") - 30] = 'Q';
  refused(bad_next, "no zip local header at decoded byte " + std::to_string(good.find("item/byteorder") - 30));
  // Compressed inside the zip; flags other than a descriptor and UTF-8 names (here: encrypted).
  refused(with_local_field(good, "data/0", 8, 8), "is compressed inside the zip (method 8)");
  refused(with_local_field(good, "byteorder", 6, 0x0809), "(encrypted, or not written by torch)");
  // A descriptor flag with CRC and sizes in the local header as well.
  std::string both = good;
  both[good.find("item/data.pkl") - 30 + 14] = 1;
  refused(both, "leaves its CRC-32 and size to a data descriptor but also gives them");
  // A data descriptor that does not match its data: no end is found for the record.
  std::string bad_crc = good;
  const size_t descriptor = good.find("item/.format_version") - 30 - 16;
  ASSERT_EQ(load_le<uint32_t>(good.data() + descriptor), kDataDescriptorSig);
  bad_crc[descriptor + 4] = static_cast<char>(bad_crc[descriptor + 4] ^ 1);
  refused(bad_crc, "inside record 'item/data.pkl' and its data descriptor");
  // The storage record's header beyond the bound (a large record before it).
  std::vector<Record> records = torch_records(6, 40, 240);
  records.insert(records.begin() + 1, {"padding", std::string(2u << 20, 'p')});
  refused(archive(dir, records), "does not lie within its first 1048576 decoded bytes");
  refused(good, "does not lie within its first 200 decoded bytes", 200);
  // Not torch's order or naming.
  refused(archive(dir, {{"byteorder", "little"}, {"data.pkl", tensor_pickle(240, 6, 40)}}),
          "its first record is 'item/byteorder', not '<archive>/data.pkl'");
  std::string outside = good;
  outside.replace(good.find("item/byteorder"), 4, "meti");
  refused(outside, "record 'meti/byteorder' is outside 'item/'");
  // Big-endian data.
  records = torch_records(6, 40, 240);
  records[3].data = "big";
  refused(archive(dir, records), "big-endian");
}

}  // namespace
}  // namespace shardmerge
