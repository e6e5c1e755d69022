// DCP items (src/formats/dcp.cpp, locate_dcp_chunk) compressed with torch's stream.zstd
// transform: the decompressed item is bounded by what .metadata says the chunk is (its
// shape and dtype, plus a torch.save archive's small overhead), whatever the frame claims.
// Items are torch.save archives written with the repository's writers and compressed here
// with libzstd, the way torch's ZStandard extension streams them (no content size).
#include <gtest/gtest.h>
#include <zstd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "formats/dcp.hpp"
#include "formats/pickle_writer.hpp"
#include "formats/torch_writer.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

// torch.save(zeros(n, dtype=float32)), plus an extra record of `extra` bytes.
std::string item_archive(const TempDir& dir, int64_t n, uint64_t extra = 0) {
  pickle::Writer w;
  w.global("torch._utils", "_rebuild_tensor_v2").mark();
  w.mark().str("storage").global("torch", "FloatStorage").str("0").str("cpu").integer(n).tuple().binpersid();
  w.integer(0).int_tuple({n}).int_tuple({1}).boolean(false).global("collections", "OrderedDict").empty_tuple().reduce();
  w.tuple().reduce();
  const std::string path = dir / "item.pt";
  TorchArchiveWriter zip(path, "item");
  zip.add_record("data.pkl", w.finish());
  zip.add_record("byteorder", "little");
  zip.add_record("data/0", std::string(static_cast<size_t>(n) * 4, '\0'));
  if (extra) zip.add_record("padding", std::string(extra, '\0'));
  zip.finish();
  return test::read_file(path);
}

// One zstd frame; `declare_size` writes the content size into the frame header.
std::string zstd_frame(const std::string& data, bool declare_size) {
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> ctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_contentSizeFlag, declare_size ? 1 : 0);
  std::string out(ZSTD_compressBound(data.size()), '\0');
  ZSTD_inBuffer in{data.data(), data.size(), 0};
  ZSTD_outBuffer dst{out.data(), out.size(), 0};
  const size_t left = ZSTD_compressStream2(ctx.get(), &dst, &in, ZSTD_e_end);
  EXPECT_EQ(left, 0u);
  out.resize(dst.pos);
  return out;
}

// Describes an item holding float32[n] at offset 0 of __0_0.distcp, with `bytes` as that file.
DcpChunkData locate(const TempDir& dir, const std::string& bytes, int64_t n) {
  write_small_file(dir / "__0_0.distcp", bytes, /*overwrite=*/true);
  DcpMetadata meta;
  meta.dir = dir.path().string();
  DcpTensor t;
  t.fqn = "w";
  t.dtype = DType::F32;
  t.size = {n};
  DcpChunk c;
  c.offsets = {0};
  c.sizes = {n};
  c.relative_path = "__0_0.distcp";
  c.length = bytes.size();
  c.transforms = {"stream.zstd/1"};
  t.chunks.push_back(c);
  return locate_dcp_chunk(meta, t, t.chunks[0], dir / "scratch");
}

std::string locate_error(const TempDir& dir, const std::string& bytes, int64_t n) {
  try {
    locate(dir, bytes, n);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(DcpZstd, ItemsDecompressWithAndWithoutADeclaredSize) {
  TempDir dir;
  const std::string item = item_archive(dir, 1000);
  for (const bool declared : {false, true}) {
    const DcpChunkData data = locate(dir, zstd_frame(item, declared), 1000);
    EXPECT_EQ(data.view.size, std::vector<int64_t>{1000});
    EXPECT_EQ(File::open_read(data.path).size(), item.size());
  }
}

TEST(DcpZstd, AnItemLargerThanItsChunkIsRefusedAsItStreams) {
  // 64 MB of zeros compress to a few kB; .metadata says the chunk is 4 kB of float32.
  TempDir dir;
  const std::string bomb = item_archive(dir, 1000, 64u << 20);
  const std::string what = locate_error(dir, zstd_frame(bomb, false), 1000);
  EXPECT_NE(what.find("decompresses to more than the 1052576 bytes"), std::string::npos) << what;
  EXPECT_NE(what.find("tensor 'w'"), std::string::npos) << what;
  EXPECT_LT(std::filesystem::file_size(dir / "scratch/__0_0.distcp.0.item"), 2u << 20);
  // A frame that declares it is that large is refused before anything is decompressed.
  const std::string declared = locate_error(dir, zstd_frame(bomb, true), 1000);
  EXPECT_NE(declared.find("its frame declares " + std::to_string(bomb.size()) + " bytes, more than the 1052576"),
            std::string::npos)
      << declared;
}

TEST(DcpZstd, BytesAfterTheFrameAreRefused) {
  TempDir dir;
  const std::string frame = zstd_frame(item_archive(dir, 1000), false);
  const std::string what = locate_error(dir, frame + frame, 1000);
  EXPECT_NE(what.find(std::to_string(frame.size()) + " bytes follow the end of its zstd frame"), std::string::npos) << what;
  const std::string truncated = locate_error(dir, frame.substr(0, frame.size() - 3), 1000);
  EXPECT_NE(truncated.find("zstd item: truncated"), std::string::npos) << truncated;
}

TEST(DcpZstd, ChunkSizesThatOverflowAreErrors) {
  TempDir dir;
  const std::string frame = zstd_frame(item_archive(dir, 4), false);
  write_small_file(dir / "__0_0.distcp", frame, /*overwrite=*/true);
  DcpMetadata meta;
  meta.dir = dir.path().string();
  DcpTensor t;
  t.fqn = "w";
  DcpChunk c;
  c.offsets = {0, 0};
  c.sizes = {int64_t{1} << 31, int64_t{1} << 31};  // 2^62 elements of 4 bytes
  c.relative_path = "__0_0.distcp";
  c.length = frame.size();
  c.transforms = {"stream.zstd/1"};
  try {
    locate_dcp_chunk(meta, t, c, dir / "scratch");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has more than 2^64 bytes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardmerge
