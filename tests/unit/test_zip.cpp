// The zip container of torch.save files (src/formats/zip.*): real rank files, hand-built
// archives with ZIP64 records for entries and offsets past 4 GiB (sparse files, so nothing
// large is written), and every way the directory can be wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "formats/torch_writer.hpp"
#include "formats/zip.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/bytes.hpp"
#include "util/crc32.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

using test::fixtures_dir;
using test::TempDir;

constexpr uint64_t k4GiB = 1ull << 32;

// ---- a zip writer that can also write what no writer should ---------------------------------

// One central-directory record; tests edit these before finish() to break the directory.
struct CentralRecord {
  std::string name;
  uint16_t method = 0;
  uint32_t crc = 0;
  uint64_t csize = 0, usize = 0, lho = 0;
};

// Writes entries the way torch's miniz writer lays them out (stored, an "FB" extra field that
// pads data to 64 bytes, ZIP64 fields and end records), straight to a file so that entries and
// offsets past 4 GiB are holes in a sparse file.
class ZipWriter {
 public:
  explicit ZipWriter(std::string path) : path_(std::move(path)), file_(File::create(path_)) {}

  CentralRecord& add(const std::string& name, const std::string& data) {
    CentralRecord& r = begin(name, data.size(), crc32_update(0, data.data(), data.size()));
    file_.write_exact(cursor_, data.data(), data.size());
    cursor_ += data.size();
    return r;
  }

  // An entry whose data is never written: a hole of `size` bytes.
  CentralRecord& add_sparse(const std::string& name, uint64_t size) {
    CentralRecord& r = begin(name, size, 0);  // nothing reads a hole's bytes: its CRC is never checked
    cursor_ += size;
    return r;
  }

  void skip(uint64_t bytes) { cursor_ += bytes; }
  uint64_t cursor() const { return cursor_; }
  std::vector<CentralRecord>& records() { return records_; }

  struct EndOptions {
    bool zip64 = true;          // ZIP64 end record and locator (torch always writes them)
    std::string comment;        // archive comment after the EOCD
    std::function<void(std::string& eocd, std::string& zip64_eocd, std::string& locator)> edit;
  };

  // Central directory, end records; returns the offset of the central directory.
  uint64_t finish(const EndOptions& options) {
    const uint64_t cd_offset = cursor_;
    std::string cd;
    for (const auto& r : records_) {
      const bool big_size = r.usize >= 0xFFFFFFFFu || r.csize >= 0xFFFFFFFFu;
      const bool big_offset = r.lho >= 0xFFFFFFFFu;
      std::string extra;
      if (big_size || big_offset) {
        std::string z;
        if (big_size) {
          append_le<uint64_t>(z, r.usize);
          append_le<uint64_t>(z, r.csize);
        }
        if (big_offset) append_le<uint64_t>(z, r.lho);
        append_le<uint16_t>(extra, 0x0001);
        append_le<uint16_t>(extra, static_cast<uint16_t>(z.size()));
        extra += z;
      }
      append_le<uint32_t>(cd, 0x02014b50);
      append_le<uint16_t>(cd, 0x031E);  // made by
      append_le<uint16_t>(cd, 45);      // needed
      append_le<uint16_t>(cd, 0);       // flags
      append_le<uint16_t>(cd, r.method);
      append_le<uint32_t>(cd, 0);  // time, date
      append_le<uint32_t>(cd, r.crc);
      append_le<uint32_t>(cd, big_size ? 0xFFFFFFFFu : static_cast<uint32_t>(r.csize));
      append_le<uint32_t>(cd, big_size ? 0xFFFFFFFFu : static_cast<uint32_t>(r.usize));
      append_le<uint16_t>(cd, static_cast<uint16_t>(r.name.size()));
      append_le<uint16_t>(cd, static_cast<uint16_t>(extra.size()));
      append_le<uint16_t>(cd, 0);  // comment
      append_le<uint16_t>(cd, 0);  // disk
      append_le<uint16_t>(cd, 0);  // internal attributes
      append_le<uint32_t>(cd, 0);  // external attributes
      append_le<uint32_t>(cd, big_offset ? 0xFFFFFFFFu : static_cast<uint32_t>(r.lho));
      cd += r.name + extra;
    }
    file_.write_exact(cursor_, cd.data(), cd.size());
    cursor_ += cd.size();

    std::string zip64_eocd, locator, eocd;
    const uint64_t zip64_offset = cursor_;
    const uint64_t n = records_.size();
    append_le<uint32_t>(zip64_eocd, 0x06064b50);
    append_le<uint64_t>(zip64_eocd, 44);
    append_le<uint16_t>(zip64_eocd, 0x031E);
    append_le<uint16_t>(zip64_eocd, 45);
    append_le<uint32_t>(zip64_eocd, 0);
    append_le<uint32_t>(zip64_eocd, 0);
    append_le<uint64_t>(zip64_eocd, n);
    append_le<uint64_t>(zip64_eocd, n);
    append_le<uint64_t>(zip64_eocd, cd.size());
    append_le<uint64_t>(zip64_eocd, cd_offset);
    append_le<uint32_t>(locator, 0x07064b50);
    append_le<uint32_t>(locator, 0);
    append_le<uint64_t>(locator, zip64_offset);
    append_le<uint32_t>(locator, 1);
    append_le<uint32_t>(eocd, 0x06054b50);
    append_le<uint16_t>(eocd, 0);
    append_le<uint16_t>(eocd, 0);
    append_le<uint16_t>(eocd, static_cast<uint16_t>(n));
    append_le<uint16_t>(eocd, static_cast<uint16_t>(n));
    append_le<uint32_t>(eocd, static_cast<uint32_t>(cd.size()));
    append_le<uint32_t>(eocd, cd_offset >= 0xFFFFFFFFu ? 0xFFFFFFFFu : static_cast<uint32_t>(cd_offset));
    append_le<uint16_t>(eocd, static_cast<uint16_t>(options.comment.size()));
    if (options.edit) options.edit(eocd, zip64_eocd, locator);
    std::string tail = options.zip64 ? zip64_eocd + locator + eocd : eocd;
    tail += options.comment;
    file_.write_exact(cursor_, tail.data(), tail.size());
    cursor_ += tail.size();
    file_.close();
    return cd_offset;
  }
  uint64_t finish() { return finish(EndOptions{}); }

  // Where add() put the data of the last entry.
  uint64_t last_data_offset() const { return last_data_offset_; }

 private:
  // Local header with a ZIP64 field when the size needs one, then an FB field padding the data
  // to a multiple of 64 (torch's alignment).
  CentralRecord& begin(const std::string& name, uint64_t size, uint32_t crc) {
    const bool big_size = size >= 0xFFFFFFFFu;
    std::string extra;
    if (big_size) {
      append_le<uint16_t>(extra, 0x0001);
      append_le<uint16_t>(extra, 16);
      append_le<uint64_t>(extra, size);
      append_le<uint64_t>(extra, size);
    }
    const uint64_t unpadded = cursor_ + 30 + name.size() + extra.size() + 4;
    const uint64_t pad = (64 - unpadded % 64) % 64;
    append_le<uint16_t>(extra, 0x4246);  // "FB"
    append_le<uint16_t>(extra, static_cast<uint16_t>(pad));
    extra.append(pad, 'Z');

    std::string h;
    append_le<uint32_t>(h, 0x04034b50);
    append_le<uint16_t>(h, 45);
    append_le<uint16_t>(h, 0);  // flags
    append_le<uint16_t>(h, 0);  // method
    append_le<uint32_t>(h, 0);  // time, date
    append_le<uint32_t>(h, crc);  // no data descriptor (flag bit 3 clear): CRC and sizes are here
    append_le<uint32_t>(h, big_size ? 0xFFFFFFFFu : static_cast<uint32_t>(size));
    append_le<uint32_t>(h, big_size ? 0xFFFFFFFFu : static_cast<uint32_t>(size));
    append_le<uint16_t>(h, static_cast<uint16_t>(name.size()));
    append_le<uint16_t>(h, static_cast<uint16_t>(extra.size()));
    h += name + extra;
    file_.write_exact(cursor_, h.data(), h.size());
    records_.push_back({name, 0, crc, size, size, cursor_});
    cursor_ += h.size();
    last_data_offset_ = cursor_;
    return records_.back();
  }

  std::string path_;
  File file_;
  uint64_t cursor_ = 0;
  uint64_t last_data_offset_ = 0;
  std::vector<CentralRecord> records_;
};

// The what() of the Error that reading `path` as a zip throws; fails the test when none is.
std::string zip_error(const std::string& path) {
  try {
    const File f = File::open_read(path);
    ZipArchive::read(f);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "reading " << path << " did not fail";
  return "";
}

void expect_zip_error(const std::string& path, const std::string& substring) {
  const std::string what = zip_error(path);
  EXPECT_NE(what.find(substring), std::string::npos) << what;
  EXPECT_NE(what.find(path), std::string::npos) << "the error must name the file: " << what;
}

// Overwrites bytes of a file in place.
void patch(const std::string& path, uint64_t offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

template <typename T>
std::string le(T v) {
  std::string s;
  append_le<T>(s, v);
  return s;
}

// A small valid archive: arc/data.pkl and arc/version.
void write_small(ZipWriter& w) {
  w.add("arc/data.pkl", "\x80\x02N.");
  w.add("arc/version", "3\n");
}

// ---- real files ----------------------------------------------------------------------------

std::vector<std::string> real_torch_files() {
  const std::string root = fixtures_dir();
  return {root + "/qwen2_fsdp2_w2/global_step_3/actor/model_world_size_2_rank_1.pt",
          root + "/qwen2_fsdp1_sharded_tensor_w2/global_step_3/actor/model_world_size_2_rank_0.pt",
          root + "/qwen2_fsdp2_tp_2x2/global_step_3/actor/optim_world_size_4_rank_3.pt",
          root + "/qwen2_fsdp2_w2/global_step_3/actor/extra_state_world_size_2_rank_0.pt",
          root + "/qwen2_fsdp2_w2/global_step_3/data.pt"};
}

TEST(ZipRealFiles, EveryRecordsOffsetAndSizeAreRight) {
  SHARDMERGE_REQUIRE_FIXTURES();
  for (const std::string& path : real_torch_files()) {
    SCOPED_TRACE(path);
    const File f = File::open_read(path);
    const ZipArchive zip = ZipArchive::read(f);
    ASSERT_GE(zip.entries().size(), 5u);
    for (const ZipEntry& e : zip.entries()) {
      SCOPED_TRACE(e.name);
      EXPECT_EQ(e.data_offset % 64, 0u) << "torch aligns record data to 64 bytes";
      ASSERT_LE(e.data_offset + e.size, f.size());
      // The central directory's CRC-32 covers exactly [data_offset, data_offset + size).
      const std::string data = f.read_string(e.data_offset, e.size);
      EXPECT_EQ(crc32_update(0, data.data(), data.size()), e.crc32);
    }
    const std::string stem = std::filesystem::path(path).stem().string();
    const ZipEntry* pkl = zip.find(stem + "/data.pkl");
    ASSERT_NE(pkl, nullptr);
    EXPECT_EQ(&zip.entries().front(), pkl) << "data.pkl is written first";
    const std::string pickle = f.read_string(pkl->data_offset, pkl->size);
    EXPECT_EQ(pickle.substr(0, 2), "\x80\x02") << "PROTO 2";
    EXPECT_EQ(pickle.back(), '.') << "STOP is the last byte";
    const ZipEntry* version = zip.find(stem + "/version");
    ASSERT_NE(version, nullptr);
    EXPECT_EQ(f.read_string(version->data_offset, version->size), "3\n");
    const ZipEntry* format = zip.find(stem + "/.format_version");
    ASSERT_NE(format, nullptr);
    EXPECT_EQ(f.read_string(format->data_offset, format->size), "1");
    const ZipEntry* id = zip.find(stem + "/.data/serialization_id");
    ASSERT_NE(id, nullptr);
    EXPECT_EQ(id->size, 40u);
    EXPECT_EQ(zip.find(stem + "/no_such_record"), nullptr);
  }
}

TEST(ZipRealFiles, TorchArchivePrefixAndRecords) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const std::string path = real_torch_files().front();
  const File f = File::open_read(path);
  const TorchArchive archive = TorchArchive::read(f);
  EXPECT_EQ(archive.archive_name(), "model_world_size_2_rank_1");
  const ZipEntry& byteorder = archive.record("byteorder");
  EXPECT_EQ(f.read_string(byteorder.data_offset, byteorder.size), "little");
  ASSERT_NE(archive.find_record("data/0"), nullptr);
  EXPECT_EQ(archive.find_record("data/0")->name, "model_world_size_2_rank_1/data/0");
  EXPECT_EQ(archive.find_record("model_world_size_2_rank_1/data/0"), nullptr) << "records are named without the prefix";
  try {
    archive.record("data/999");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no record 'model_world_size_2_rank_1/data/999'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

// ---- ZIP64 ---------------------------------------------------------------------------------

TEST(ZipZip64, EntryOfMoreThan4GiBUsesSentinelsAndTheZip64Extra) {
  TempDir dir;
  const std::string path = dir / "big.zip";
  ZipWriter w(path);
  const uint64_t big = k4GiB + 100;
  w.add_sparse("big/data/0", big);
  const uint64_t data_offset = w.last_data_offset();
  w.add("big/version", "3\n");
  const uint64_t version_data = w.last_data_offset();
  const uint64_t cd = w.finish();
  ASSERT_GT(cd, k4GiB);  // the directory offset is itself a ZIP64 value

  const File f = File::open_read(path);
  const ZipArchive zip = ZipArchive::read(f);
  ASSERT_EQ(zip.entries().size(), 2u);
  const ZipEntry* e = zip.find("big/data/0");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->size, big);
  EXPECT_EQ(e->data_offset, data_offset);
  EXPECT_EQ(data_offset % 64, 0u);
  // The entry after it has its local header past 4 GiB: a ZIP64 offset in the directory.
  const ZipEntry* v = zip.find("big/version");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->data_offset, version_data);
  EXPECT_EQ(f.read_string(v->data_offset, v->size), "3\n");
}

TEST(ZipZip64, LocalHeaderPast4GiB) {
  TempDir dir;
  const std::string path = dir / "far.zip";
  ZipWriter w(path);
  w.add("far/data.pkl", "\x80\x02N.");
  w.skip(k4GiB);  // a hole: unreferenced bytes between records are allowed
  const CentralRecord& far = w.add("far/data/1", "0123456789abcdef");
  ASSERT_GE(far.lho, 0xFFFFFFFFu);
  const uint64_t far_lho = far.lho;
  const uint64_t far_data = w.last_data_offset();
  w.finish();

  const File f = File::open_read(path);
  const ZipArchive zip = ZipArchive::read(f);
  const ZipEntry* e = zip.find("far/data/1");
  ASSERT_NE(e, nullptr);
  EXPECT_GT(e->data_offset, far_lho);
  EXPECT_EQ(e->data_offset, far_data);
  EXPECT_EQ(e->size, 16u);
  EXPECT_EQ(f.read_string(e->data_offset, e->size), "0123456789abcdef");
  EXPECT_EQ(e->crc32, crc32_update(0, "0123456789abcdef", 16));
}

TEST(ZipZip64, ArchiveWithoutZip64RecordsAndWithAComment) {
  TempDir dir;
  const std::string path = dir / "plain.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = false, .comment = "written by a test", .edit = {}});
  const File f = File::open_read(path);
  const ZipArchive zip = ZipArchive::read(f);
  ASSERT_EQ(zip.entries().size(), 2u);
  EXPECT_EQ(zip.entries()[1].name, "arc/version");
  EXPECT_EQ(f.read_string(zip.entries()[1].data_offset, 2), "3\n");
}

TEST(ZipZip64, ArchiveEmbeddedAtAnOffset) {
  // A DCP .distcp file holds whole torch.save archives back to back.
  TempDir dir;
  const std::string inner = dir / "inner.zip";
  {
    ZipWriter w(inner);
    write_small(w);
    w.finish();
  }
  const std::string archive = test::read_file(inner);
  const std::string outer = dir / "outer.bin";
  const std::string junk_before(1000, 'j'), junk_after(77, 'k');
  {
    const File f = File::create(outer);
    const std::string all = junk_before + archive + junk_after;
    f.write_exact(0, all.data(), all.size());
  }
  const File f = File::open_read(outer);
  const ZipArchive zip = ZipArchive::read(f, junk_before.size(), archive.size());
  const ZipEntry* v = zip.find("arc/version");
  ASSERT_NE(v, nullptr);
  EXPECT_GE(v->data_offset, junk_before.size());  // absolute offsets in the outer file
  EXPECT_EQ(f.read_string(v->data_offset, v->size), "3\n");
  // Without the length, the trailing bytes hide the end record.
  try {
    ZipArchive::read(f, junk_before.size());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no end-of-central-directory record"), std::string::npos) << e.what();
  }
  try {
    ZipArchive::read(f, junk_before.size(), f.size());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

// ---- errors --------------------------------------------------------------------------------

TEST(ZipErrors, CompressedEntry) {
  TempDir dir;
  const std::string path = dir / "deflate.zip";
  ZipWriter w(path);
  write_small(w);
  w.records()[0].method = 8;
  w.finish();
  expect_zip_error(path, "'arc/data.pkl' is compressed (method 8)");
}

TEST(ZipErrors, OverlappingEntries) {
  TempDir dir;
  const std::string path = dir / "overlap.zip";
  ZipWriter w(path);
  w.add("arc/a", std::string(100, 'a'));
  w.add("arc/b", std::string(100, 'b'));
  // 'a' claims 200 bytes, in its local header too: its data now runs over b's header and data,
  // still inside the data area.
  w.records()[0].usize = w.records()[0].csize = 200;
  const uint64_t lho = w.records()[0].lho;
  w.finish();
  {
    std::string sizes;
    append_le<uint32_t>(sizes, 200);
    append_le<uint32_t>(sizes, 200);
    patch(path, lho + 18, sizes);
  }
  expect_zip_error(path, "entries 'arc/a' and 'arc/b' overlap");
}

TEST(ZipErrors, TwoEntriesOnTheSameLocalHeader) {
  TempDir dir;
  const std::string path = dir / "alias.zip";
  ZipWriter w(path);
  w.add("arc/a", std::string(10, 'a'));
  w.add("arc/b", std::string(10, 'b'));
  w.records()[1].lho = w.records()[0].lho;
  w.finish();
  expect_zip_error(path, "entry 'arc/b': its local header at 0 names it 'arc/a'");
}

TEST(ZipErrors, TruncatedFile) {
  TempDir dir;
  const std::string path = dir / "truncated.zip";
  ZipWriter w(path);
  w.add("arc/data/0", std::string(5000, 'x'));
  write_small(w);
  w.finish();
  std::filesystem::resize_file(path, 3000);  // cut inside the first record's data
  expect_zip_error(path, "truncated");
}

TEST(ZipErrors, EndOfCentralDirectoryMissing) {
  TempDir dir;
  const std::string path = dir / "no_eocd.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = true, .comment = {}, .edit = [](std::string& eocd, std::string&, std::string&) { eocd[0] = 'Q'; }});
  expect_zip_error(path, "no end-of-central-directory record");
  // A file shorter than an end record.
  const std::string tiny = dir / "tiny.zip";
  {
    const File f = File::create(tiny);
    f.write_exact(0, "PK\x05\x06", 4);
  }
  expect_zip_error(tiny, "only 4 bytes");
}

TEST(ZipErrors, CentralDirectoryPastTheFile) {
  TempDir dir;
  const std::string path = dir / "cd_past.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = true, .comment = {}, .edit = [](std::string&, std::string& z64, std::string&) {
              const uint64_t far = 1ull << 40;
              std::memcpy(z64.data() + 48, &far, 8);  // central directory offset
            }});
  expect_zip_error(path, "does not fit before its end record");
}

TEST(ZipErrors, Zip64LocatorOutOfBounds) {
  TempDir dir;
  const std::string path = dir / "locator.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = true, .comment = {}, .edit = [](std::string&, std::string&, std::string& locator) {
              const uint64_t far = 1ull << 50;
              std::memcpy(locator.data() + 8, &far, 8);
            }});
  expect_zip_error(path, "ZIP64 end record offset");
}

TEST(ZipErrors, EntryDataPastTheDataArea) {
  TempDir dir;
  const std::string path = dir / "past.zip";
  ZipWriter w(path);
  write_small(w);
  w.records()[1].usize = w.records()[1].csize = 1 << 20;
  w.finish();
  expect_zip_error(path, "'arc/version' data");
  expect_zip_error(path, "runs past the data area");
}

TEST(ZipErrors, LocalHeaderPastTheDataArea) {
  TempDir dir;
  const std::string path = dir / "lho.zip";
  ZipWriter w(path);
  write_small(w);
  w.records()[1].lho = ~uint64_t{0} - 10;  // ZIP64 value near 2^64: lho + 30 wraps around
  w.finish();
  expect_zip_error(path, "local header at 18446744073709551605 is outside the data area");
}

TEST(ZipErrors, DuplicateNames) {
  TempDir dir;
  const std::string path = dir / "dup.zip";
  ZipWriter w(path);
  w.add("arc/data.pkl", "a");
  w.add("arc/data.pkl", "b");
  w.finish();
  expect_zip_error(path, "duplicate entry 'arc/data.pkl'");
}

TEST(ZipErrors, BadLocalHeaderSignature) {
  TempDir dir;
  const std::string path = dir / "sig.zip";
  ZipWriter w(path);
  write_small(w);
  w.records()[1].lho += 1;  // points one byte into the header
  w.finish();
  expect_zip_error(path, "no local header for entry 'arc/version'");
}

TEST(ZipErrors, StoredSizesDisagree) {
  TempDir dir;
  const std::string path = dir / "sizes.zip";
  ZipWriter w(path);
  write_small(w);
  w.records()[1].csize = 1;
  w.finish();
  expect_zip_error(path, "compressed size 1 != size 2");
}

TEST(ZipErrors, MultiDiskArchive) {
  TempDir dir;
  const std::string path = dir / "disk.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = false, .comment = {}, .edit = [](std::string& eocd, std::string&, std::string&) { eocd[4] = 1; }});
  expect_zip_error(path, "multi-disk");
}

TEST(ZipErrors, CentralDirectoryEndsEarly) {
  TempDir dir;
  const std::string path = dir / "count.zip";
  ZipWriter w(path);
  write_small(w);
  w.finish({.zip64 = true, .comment = {}, .edit = [](std::string&, std::string& z64, std::string&) {
              const uint64_t many = 3;
              std::memcpy(z64.data() + 32, &many, 8);  // entries on this disk
            }});
  expect_zip_error(path, "central directory ends after 2 of 3 entries");
}

// ---- torch.save archive rules --------------------------------------------------------------

std::string torch_archive_error(const std::string& path) {
  try {
    const File f = File::open_read(path);
    TorchArchive::read(f);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "reading " << path << " did not fail";
  return "";
}

void expect_torch_archive_error(const std::string& path, const std::string& substring) {
  const std::string what = torch_archive_error(path);
  EXPECT_NE(what.find(substring), std::string::npos) << what;
  EXPECT_NE(what.find(path), std::string::npos) << "the error must name the file: " << what;
}

TEST(ZipTorchArchive, WrongMagic) {
  TempDir dir;
  const std::string path = dir / "magic.pt";
  {
    ZipWriter w(path);
    write_small(w);
    w.finish();
  }
  {
    const File f = File::open_read(path);
    ASSERT_NO_THROW(TorchArchive::read(f));
  }
  std::string bytes = test::read_file(path);
  bytes.replace(0, 4, "NOPE");
  std::filesystem::remove(path);
  write_small_file(path, bytes);
  expect_torch_archive_error(path, "wrong magic bytes");

  const std::string legacy = dir / "legacy.pt";
  write_small_file(legacy, "PYTORCH1" + std::string(100, '\0'));
  expect_torch_archive_error(legacy, "PYTORCH1");
}

TEST(ZipTorchArchive, AllEntriesShareTheFirstEntrysFolder) {
  TempDir dir;
  const std::string path = dir / "mixed.pt";
  ZipWriter w(path);
  w.add("arc/data.pkl", "\x80\x02N.");
  w.add("other/version", "3\n");
  w.finish();
  expect_torch_archive_error(path, "entry 'other/version' is outside 'arc/'");

  const std::string flat = dir / "flat.pt";
  ZipWriter f(flat);
  f.add("data.pkl", "\x80\x02N.");
  f.finish();
  expect_torch_archive_error(flat, "first entry 'data.pkl' has no '<archive>/' prefix");
}

TEST(ZipTorchArchive, NeedsDataPklAndLittleEndian) {
  TempDir dir;
  const std::string no_pickle = dir / "no_pickle.pt";
  {
    ZipWriter w(no_pickle);
    w.add("arc/version", "3\n");
    w.finish();
  }
  expect_torch_archive_error(no_pickle, "no data.pkl record");

  const std::string big_endian = dir / "big_endian.pt";
  {
    ZipWriter w(big_endian);
    w.add("arc/data.pkl", "\x80\x02N.");
    w.add("arc/byteorder", "big");
    w.finish();
  }
  expect_torch_archive_error(big_endian, "big-endian");

  const std::string empty = dir / "empty.pt";
  {
    ZipWriter w(empty);
    w.finish();
  }
  // An empty archive has no local header at byte 0, so it fails the magic check first.
  expect_torch_archive_error(empty, "magic");
}

// ---- local headers against the central directory -------------------------------------------

// Each field of the local header of arc/data/0 (16 bytes, no data descriptor), changed alone,
// is refused: the central directory is what the reader believes, and the local copy must agree.
TEST(ZipLocalHeader, EveryFieldMustAgreeWithTheCentralDirectory) {
  struct Edit {
    const char* what;
    uint64_t at;  // from the local header's start
    std::string bytes;
    const char* error;
  };
  const std::vector<Edit> edits = {
      {"name", 30 + 9, "1", "names it 'arc/data/1'"},
      {"name length", 26, le<uint16_t>(9), "names it 'arc/data/'"},
      {"method", 8, le<uint16_t>(8), "has method 8, the central directory 0"},
      {"flags", 6, le<uint16_t>(0x0800), "has flags 0x00000800, the central directory 0x00000000"},
      {"crc", 14, le<uint32_t>(0x12345678), "says CRC-32 0x12345678"},
      {"compressed size", 18, le<uint32_t>(15), "(15 stored)"},
      {"size", 22, le<uint32_t>(17), "17 bytes"},
  };
  for (const Edit& e : edits) {
    SCOPED_TRACE(e.what);
    TempDir dir;
    const std::string path = dir / "local.zip";
    ZipWriter w(path);
    w.add("arc/data.pkl", "\x80\x02N.");
    const uint64_t lho = w.add("arc/data/0", "0123456789abcdef").lho;
    w.finish();
    {
      const File f = File::open_read(path);
      EXPECT_NO_THROW(ZipArchive::read(f));
    }
    patch(path, lho + e.at, e.bytes);
    expect_zip_error(path, std::string("entry 'arc/data/0': its local header at ") + std::to_string(lho));
    expect_zip_error(path, e.error);
  }
}

// torch's layout: flag bit 3, zeros in the local header, CRC and sizes in a data descriptor
// after the data; the descriptor must agree with the central directory too.
TEST(ZipLocalHeader, DataDescriptorsMustAgreeWithTheCentralDirectory) {
  TempDir dir;
  const std::string path = dir / "torch.pt";
  {
    TorchArchiveWriter w(path, "torch");
    w.add_record("data.pkl", std::string("\x80\x02N.", 4));
    w.add_record("byteorder", "little");
    w.add_record("data/0", "0123456789abcdef");
    w.finish();
  }
  uint64_t data = 0;
  {
    const File f = File::open_read(path);
    const TorchArchive archive = TorchArchive::read(f);
    data = archive.record("data/0").data_offset;
    ASSERT_EQ(f.read_string(data + 16, 4), le<uint32_t>(0x08074b50)) << "a signed 16-byte descriptor follows";
  }
  const std::string good = test::read_file(path);
  for (const auto& [at, bytes, error] : std::vector<std::tuple<uint64_t, std::string, std::string>>{
           {4, le<uint32_t>(0xdeadbeef), "data descriptor at " + std::to_string(data + 16) + " says CRC-32 0xdeadbeef"},
           {8, le<uint32_t>(15), "(15 stored)"},
           {12, le<uint32_t>(17), "17 bytes"}}) {
    SCOPED_TRACE(error);
    patch(path, data + 16 + at, bytes);
    expect_zip_error(path, error);
    patch(path, 0, good);
  }
}

// Records read while planning (data.pkl, byteorder) are checked against their CRC-32 as read.
TEST(ZipLocalHeader, RecordsReadWhilePlanningAreChecked) {
  TempDir dir;
  const std::string path = dir / "torch.pt";
  {
    TorchArchiveWriter w(path, "torch");
    w.add_record("data.pkl", std::string("\x80\x02N.", 4));
    w.finish();
  }
  const File f = File::open_read(path);
  const ZipEntry pkl = TorchArchive::read(f).record("data.pkl");
  EXPECT_EQ(read_record_checked(f, pkl), std::string("\x80\x02N.", 4));
  patch(path, pkl.data_offset + 2, "X");
  try {
    read_record_checked(f, pkl);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch: record torch/data.pkl"), std::string::npos) << e.what();
    EXPECT_EQ(e.file(), path);
  }
}

}  // namespace
}  // namespace shardmerge
