// Compressed sources (SourceFile::compressed: one zstd frame inside a file, as torch DCP's
// stream.zstd transform stores items): the streaming decoder (util/zstd_frame.cpp) and the
// executor reading slices of the decoded bytes through an unnamed temp file. Frames are made
// here with libzstd; the oracle for every output byte is the uncompressed input.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>

#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "util/zstd_frame.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// One zstd frame of `data`; `declare_size` writes the content size into its header (torch
// streams items without one), `checksum` appends the content checksum.
std::string zstd_frame(const std::string& data, bool declare_size, bool checksum = false) {
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> ctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_contentSizeFlag, declare_size ? 1 : 0);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_checksumFlag, checksum ? 1 : 0);
  if (declare_size) ZSTD_CCtx_setPledgedSrcSize(ctx.get(), data.size());
  std::string out(ZSTD_compressBound(data.size()), '\0');
  ZSTD_inBuffer in{data.data(), data.size(), 0};
  ZSTD_outBuffer dst{out.data(), out.size(), 0};
  EXPECT_EQ(ZSTD_compressStream2(ctx.get(), &dst, &in, ZSTD_e_end), 0u);
  out.resize(dst.pos);
  return out;
}

// Bytes that compress somewhat (small floats), so frames hold several blocks.
std::string float_bytes(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = static_cast<float>(static_cast<int>(rng() % 64) - 32) / 8;
  std::string s(n * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

// TMPDIR set to a fresh directory for the object's life, as where decoded items must go.
class ScopedTmpdir {
 public:
  explicit ScopedTmpdir(fs::path dir) : path(std::move(dir)) {
    fs::create_directories(path);
    if (const char* old = std::getenv("TMPDIR")) old_ = old;
    ::setenv("TMPDIR", path.c_str(), 1);
  }
  ~ScopedTmpdir() {
    if (old_) ::setenv("TMPDIR", old_->c_str(), 1);
    else ::unsetenv("TMPDIR");
  }
  bool empty() const { return fs::is_empty(path); }
  const fs::path path;

 private:
  std::optional<std::string> old_;
};

// A .distcp-like file: `before` bytes of other data, the frame, then other data again.
struct ItemFile {
  std::string path;
  uint64_t offset = 0, length = 0, size = 0;
};
ItemFile write_item(const std::string& path, const std::string& frame, size_t before = 123) {
  const std::string bytes = std::string(before, 'x') + frame + "the next item";
  write_small_file(path, bytes, /*overwrite=*/true);
  return {path, before, frame.size(), bytes.size()};
}

std::string decode_error(const ItemFile& item, uint64_t decoded_size) {
  try {
    File out = File::anonymous_temp();
    decode_zstd_frame(File::open_read(item.path), item.offset, item.length, decoded_size, out);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "decoded";
  return "";
}

TEST(ZstdFrame, DecodesAFrameInsideAFileWithAndWithoutADeclaredSize) {
  TempDir dir;
  ScopedTmpdir tmp(dir.path() / "tmp");
  const std::string data = float_bytes(300000, 1);  // 1.2 MB: many decoder buffers
  for (const bool declared : {false, true}) {
    const ItemFile item = write_item(dir / "item.distcp", zstd_frame(data, declared));
    File out = File::anonymous_temp();
    decode_zstd_frame(File::open_read(item.path), item.offset, item.length, data.size(), out);
    ASSERT_EQ(out.size(), data.size());
    EXPECT_TRUE(out.read_string(0, data.size()) == data);
  }
  EXPECT_TRUE(tmp.empty());
}

TEST(ZstdFrame, KeepsThePlannedBytesAndDiscardsABoundedTail) {
  TempDir dir;
  ScopedTmpdir tmp(dir.path() / "tmp");
  const std::string data = float_bytes(50000, 5);
  const std::string tail(kMaxDiscardedTail, 't');  // the most a frame may hold past the planned bytes
  for (const bool declared : {false, true}) {
    const ItemFile item = write_item(dir / "item.distcp", zstd_frame(data + tail, declared));
    File out = File::anonymous_temp();
    decode_zstd_frame(File::open_read(item.path), item.offset, item.length, data.size(), out);
    ASSERT_EQ(out.size(), data.size());
    EXPECT_TRUE(out.read_string(0, data.size()) == data);
  }
  EXPECT_TRUE(tmp.empty());
}

TEST(ZstdFrame, RefusesFramesThatDecodeToFewerThanThePlannedBytesOrPastTheTailNamingFileAndOffset) {
  TempDir dir;
  const std::string path = dir / "item.distcp";
  const std::string data = float_bytes(50000, 2);
  auto refused = [&](const ItemFile& item, uint64_t decoded_size, const std::string& why) {
    const std::string what = decode_error(item, decoded_size);
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("at byte " + std::to_string(item.offset)), std::string::npos) << what;
    EXPECT_NE(what.find(why), std::string::npos) << what;
  };
  // Decodes to fewer bytes than planned, or to more than the tail bound past them (no declared
  // size: found as it streams).
  refused(write_item(path, zstd_frame(data, false)), data.size() + 4, "decodes to 200000 bytes (the plan needs 200004");
  const std::string bomb = data + std::string(kMaxDiscardedTail + 1, 't');
  refused(write_item(path, zstd_frame(bomb, false)), data.size(),
          "decodes to more than " + std::to_string(data.size() + kMaxDiscardedTail) + " bytes");
  // Declares fewer bytes than planned, or more than the tail bound allows.
  refused(write_item(path, zstd_frame(data, true)), data.size() + 4, "its frame declares 200000 bytes");
  refused(write_item(path, zstd_frame(bomb, true)), data.size(), "its frame declares " + std::to_string(bomb.size()) + " bytes");
  // Corrupt: a flipped byte inside a checksummed frame.
  std::string corrupt = zstd_frame(data, false, /*checksum=*/true);
  corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 0x5a);
  refused(write_item(path, corrupt), data.size(), "corrupt");
  // Not a zstd frame at all.
  refused(write_item(path, data.substr(0, 1000)), 1000, "does not start with the zstd frame magic");
  // The range ends before the frame does, or holds more after it.
  const std::string frame = zstd_frame(data, false);
  ItemFile cut = write_item(path, frame);
  cut.length -= 10;
  refused(cut, data.size(), "truncated");
  ItemFile longer = write_item(path, frame);
  longer.length += 7;
  refused(longer, data.size(), "7 bytes follow the end of its zstd frame");
  refused(write_item(path, frame + frame), data.size(), std::to_string(frame.size()) + " bytes follow the end");
}

// A "__0_0.distcp" holding two compressed items: "w" [256, 128] fp32 (read as runs, then cast
// to bf16), and "cat" [16, 64], whose two column halves are stored one after the other in the
// second item (read as slabs).
class CompressedSources : public ::testing::Test {
 protected:
  TempDir dir;
  ScopedTmpdir tmp{dir.path() / "tmp"};
  std::string w = float_bytes(256 * 128, 3), cat = float_bytes(16 * 64, 4);
  std::string path = dir / "__0_0.distcp";

  // The plan over the file whose items are `frame_w` and `frame_cat`.
  MergePlan plan(const std::string& frame_w, const std::string& frame_cat, DType w_out = DType::F32) const {
    const std::string bytes = "header" + frame_w + "gap" + frame_cat + "end";
    write_small_file(path, bytes, /*overwrite=*/true);
    const uint64_t at_w = 6, at_cat = 6 + frame_w.size() + 3;
    std::vector<SourceFile> sources = {{path, bytes.size()}, {path, bytes.size()}};
    sources[0].compressed = CompressedItem{"zstd", at_w, frame_w.size(), w.size()};
    sources[1].compressed = CompressedItem{"zstd", at_cat, frame_cat.size(), cat.size()};
    OutputTensor tw{"w", w_out, {256, 128}, 0, 0, 0, {{0, 0, DType::F32, {128, 1}, {0, 0}, {256, 128}}}, std::nullopt, ""};
    OutputTensor tc{"cat", DType::F32, {16, 64}, 0, 0, 0, {}, std::nullopt, ""};
    tc.copies = {{1, 0, DType::F32, {32, 1}, {0, 0}, {16, 32}}, {1, 16 * 32 * 4, DType::F32, {32, 1}, {0, 32}, {16, 32}}};
    return test::one_file_plan({tw, tc}, sources);
  }
  MergePlan plan() const { return plan(zstd_frame(w, false), zstd_frame(cat, true)); }

  // What the executor writes for `p`, through a real output tree (copy_file_range with --no-crc).
  std::string merge(const MergePlan& p, bool check_crc) const {
    const std::string out = dir / (check_crc ? "out_crc" : "out");
    HfTreeWriter writer(out, /*force=*/true, "");
    writer.create(p);
    ExecOptions opt;
    opt.check_crc = check_crc;
    make_cpu_executor()->run(p, writer, opt);
    writer.commit(p);
    return test::read_file(out + "/model.safetensors");
  }
  std::string expected_cat() const {
    std::string out(cat.size(), '\0');
    for (size_t r = 0; r < 16; ++r)
      for (size_t half = 0; half < 2; ++half)
        std::memcpy(out.data() + (r * 64 + half * 32) * 4, cat.data() + half * 16 * 32 * 4 + r * 32 * 4, 32 * 4);
    return out;
  }
  std::string merge_error(const MergePlan& p) const {
    try {
      merge(p, true);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "merged";
    return "";
  }
};

TEST_F(CompressedSources, SlicesOfDecodedItemsMergeToTheOriginalBytesAndLeaveNoTempFile) {
  const MergePlan p = plan();
  for (const bool check_crc : {true, false}) {
    const std::string got = merge(p, check_crc);
    EXPECT_TRUE(got.substr(p.tensors[0].offset, w.size()) == w) << "w, check_crc " << check_crc;
    EXPECT_TRUE(got.substr(p.tensors[1].offset, cat.size()) == expected_cat()) << "cat, check_crc " << check_crc;
  }
  EXPECT_TRUE(tmp.empty());
}

TEST_F(CompressedSources, ItemsAreDecodedIntoTmpdir) {
  const MergePlan p = plan();
  ::setenv("TMPDIR", (dir / "missing").c_str(), 1);
  const std::string what = merge_error(p);
  EXPECT_NE(what.find(dir / "missing"), std::string::npos) << what;
}

TEST_F(CompressedSources, BrokenFramesAreRefusedNamingTheFileAndLeaveNoTempFile) {
  const std::string good = zstd_frame(cat, false);
  std::string corrupt = zstd_frame(w, false, /*checksum=*/true);
  corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 0x5a);
  const std::string short_w = zstd_frame(w.substr(0, w.size() - 8), false);
  const std::string long_w = zstd_frame(w + std::string(kMaxDiscardedTail + 1, 'x'), false);
  for (const auto& [frame_w, why] : std::vector<std::pair<std::string, std::string>>{
           {corrupt, "corrupt"},
           {short_w, "decodes to 131064 bytes (the plan needs 131072"},
           {long_w, "decodes to more than " + std::to_string(w.size() + kMaxDiscardedTail) + " bytes"},
           {zstd_frame(w, false) + "garbage", "7 bytes follow the end of its zstd frame"}}) {
    const MergePlan p = plan(frame_w, good);
    const std::string what = merge_error(p);
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find(why), std::string::npos) << what;
    EXPECT_TRUE(tmp.empty());
  }
}

TEST_F(CompressedSources, TheStampCheckedIsThatOfTheFileHoldingTheItem) {
  MergePlan p = plan();
  p.sources[1].size += 1;
  const std::string what = merge_error(p);
  EXPECT_NE(what.find(path + ": changed since the plan was made"), std::string::npos) << what;
}

TEST_F(CompressedSources, ACrcReadFromTheDecodedDataDescriptorIsCheckedAndNamedAsSuch) {
  // The item's decoded bytes are w's storage followed by a little-endian CRC-32, as a
  // torch.save archive written with data descriptors has it; planning could not read it.
  auto with_descriptor = [&](uint32_t crc) {
    std::string bytes = w;
    for (int i = 0; i < 4; ++i) bytes += static_cast<char>((crc >> (8 * i)) & 0xff);
    MergePlan p = plan(zstd_frame(bytes, false), zstd_frame(cat, true));
    p.sources[0].compressed->decoded_size = bytes.size();
    RecordCheck check;
    check.file = 0;
    check.size = w.size();
    check.record = "archive/data/0";
    check.tensor = "w";
    check.crc32_at = w.size();
    p.records = {check};
    return p;
  };
  const auto right = static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(w.data()), static_cast<uInt>(w.size())));
  const MergePlan good = with_descriptor(right);
  EXPECT_TRUE(merge(good, true).substr(good.tensors[0].offset, w.size()) == w);
  const std::string what = merge_error(with_descriptor(right ^ 1));
  EXPECT_NE(what.find("its data descriptor says"), std::string::npos) << what;
  EXPECT_NE(what.find("archive/data/0"), std::string::npos) << what;
  EXPECT_NE(what.find(path), std::string::npos) << what;
}

}  // namespace
}  // namespace shardmerge
