// libFuzzer target: DCP `.metadata` pickles (torch.distributed.checkpoint Metadata) as Megatron's
// torch_dist backend writes them, decoded into tensors, chunks and item locations. Whatever it
// accepts must be self-consistent: every chunk has as many offsets as sizes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "formats/dcp.hpp"
#include "shardmerge/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto meta = shardmerge::parse_dcp_metadata(std::string_view(reinterpret_cast<const char*>(data), size), "/dcp");
    for (const auto& t : meta.tensors)
      for (const auto& c : t.chunks)
        if (c.relative_path.find('/') != std::string::npos) std::abort();  // items stay in the directory
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
