// libFuzzer target: the decoder of compressed sources (util/zstd_frame.cpp, torch DCP's
// stream.zstd/1 items) and the reader of a decoded item's head (formats/torch_item_head.cpp).
// The first 4 bytes (little-endian, modulo 1 MiB) are the size the plan says the executor
// needs of the decoded item, the rest is the item as stored in the .distcp file, between other
// bytes. The decoder never writes past that size, and its verdict agrees with libzstd's
// one-shot decoder: it accepts exactly when the bytes are one whole zstd frame that decodes to
// at least that size and at most kMaxDiscardedTail more, with a window zstd's streaming decoder
// takes by default (a larger one is refused: it would need that much memory), and then keeps
// the first bytes of the one-shot output. The head reader, streaming the same frame, fails only with an Error.
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_getFrameHeader, ZSTD_WINDOWLOG_LIMIT_DEFAULT
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "formats/torch_item_head.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"
#include "util/zstd_frame.hpp"

#include "scratch_dir.hpp"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  static const ScratchDir scratch_dir("shardmerge-fuzz-zstd-");
  fs::create_directories(scratch_dir.path);
  const uint64_t decoded_size = (data[0] | data[1] << 8 | data[2] << 16 | static_cast<uint64_t>(data[3]) << 24) % (1u << 20);
  const std::string item(reinterpret_cast<const char*>(data) + 4, size - 4);
  const std::string path = (scratch_dir.path / "__0_0.distcp").string();
  const std::string before = "other item";
  shardmerge::write_small_file(path, before + item + "next item", /*overwrite=*/true);
  const shardmerge::File in = shardmerge::File::open_read(path);

  // Where decoded items go: an unnamed file in the scratch dir, so nothing is left behind.
  ::setenv("TMPDIR", scratch_dir.path.c_str(), 1);
  shardmerge::File out = shardmerge::File::anonymous_temp();
  bool accepted = true;
  try {
    shardmerge::decode_zstd_frame(in, before.size(), item.size(), decoded_size, out);
  } catch (const shardmerge::Error&) {
    accepted = false;
  }
  if (out.size() > decoded_size) std::abort();

  const uint64_t most = decoded_size + shardmerge::kMaxDiscardedTail;
  std::string oneshot(most + 1, '\0');  // room for one byte too many, to see it
  const size_t n = ZSTD_decompress(oneshot.data(), oneshot.size(), item.data(), item.size());
  const bool one_zstd_frame = item.size() >= 4 && static_cast<uint8_t>(item[0]) == 0x28 &&
                              static_cast<uint8_t>(item[1]) == 0xb5 && static_cast<uint8_t>(item[2]) == 0x2f &&
                              static_cast<uint8_t>(item[3]) == 0xfd &&
                              ZSTD_findFrameCompressedSize(item.data(), item.size()) == item.size();
  ZSTD_frameHeader header{};
  const bool small_window = ZSTD_getFrameHeader(&header, item.data(), item.size()) == 0 &&
                            header.windowSize <= (uint64_t{1} << ZSTD_WINDOWLOG_LIMIT_DEFAULT);
  const bool oneshot_fits = !ZSTD_isError(n) && n >= decoded_size && n <= most && small_window;
  if (accepted && (!oneshot_fits || !one_zstd_frame || out.read_string(0, decoded_size) != oneshot.substr(0, decoded_size)))
    std::abort();
  if (!accepted && oneshot_fits && one_zstd_frame) std::abort();

  try {
    shardmerge::ZstdFrameReader frame(in, before.size(), item.size());
    shardmerge::read_torch_item_head([&](char* buf, size_t k) { return frame.read(buf, k); });
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
