// libFuzzer target: safetensors header validation. The first 8 input bytes choose how many
// data bytes the pretend file holds after the header, the rest is the header JSON, so both
// the JSON checks and the offset/size arithmetic against the file size are exercised.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "formats/safetensors.hpp"
#include "shardmerge/error.hpp"
#include "util/bytes.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  const uint64_t buffer_bytes = shardmerge::load_le<uint64_t>(data);
  const std::string_view header(reinterpret_cast<const char*>(data) + 8, size - 8);
  const uint64_t header_end = 8 + header.size();
  // Saturate instead of wrapping: a file can be no larger than the address space either way.
  const uint64_t file_size = buffer_bytes > UINT64_MAX - header_end ? UINT64_MAX : header_end + buffer_bytes;
  try {
    const auto st = shardmerge::SafetensorsFile::from_header(header, file_size);
    uint64_t expected_offset = header_end;
    for (const auto& t : st.tensors()) {
      if (t.file_offset != expected_offset) std::abort();  // validation promised a contiguous buffer
      expected_offset += t.nbytes;
      if (st.find(t.name) != &t) std::abort();
    }
    if (expected_offset != file_size) std::abort();
  } catch (const shardmerge::Error&) {
  }
  return 0;
}
