// libFuzzer target: zstd-compressed DCP items (torch's stream.zstd/1 transform). The first
// byte chooses the chunk's bfloat16 element count n (what .metadata would declare: a [1, n]
// chunk, as Megatron stacks layers), the rest is the item as stored in the .distcp file.
// Decoding must stay within the declared bound: the scratch file it writes is never larger
// than the chunk's storage plus the archive overhead.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "formats/dcp.hpp"
#include "shardmerge/error.hpp"
#include "util/file.hpp"

#include "scratch_dir.hpp"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const ScratchDir scratch_dir("shardmerge-fuzz-zstd-");
  const fs::path& dir = scratch_dir.path;
  fs::create_directories(dir);
  const int64_t elements = data[0];
  const std::string item(reinterpret_cast<const char*>(data) + 1, size - 1);
  shardmerge::write_small_file((dir / "__0_0.distcp").string(), item, /*overwrite=*/true);
  shardmerge::DcpMetadata meta;
  meta.dir = dir.string();
  shardmerge::DcpTensor t;
  t.fqn = "w";
  t.dtype = shardmerge::DType::BF16;
  t.size = {1, elements};
  shardmerge::DcpChunk c;
  c.offsets = {0, 0};
  c.sizes = {1, elements};
  c.relative_path = "__0_0.distcp";
  c.length = item.size();
  c.transforms = {"stream.zstd/1"};
  const fs::path scratch = dir / "scratch";
  try {
    const auto located = shardmerge::locate_dcp_chunk(meta, t, c, scratch.string());
    if (located.view.size != c.sizes) std::abort();
  } catch (const shardmerge::Error&) {
  }
  std::error_code ec;
  const auto written = fs::file_size(scratch / "__0_0.distcp.0.item", ec);
  if (!ec && written > static_cast<uint64_t>(elements) * 2 + (1u << 20)) std::abort();
  fs::remove_all(scratch, ec);
  return 0;
}
