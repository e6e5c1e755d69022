#include "util/crc32.hpp"

#include <isa-l/crc.h>
#include <zlib.h>

namespace shardmerge {

uint32_t crc32_update(uint32_t crc, const void* data, size_t n) {
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  static_assert(sizeof(z_off_t) >= sizeof(uint64_t), "zlib's offsets must hold any record length");
  return static_cast<uint32_t>(::crc32_combine(crc_a, crc_b, static_cast<z_off_t>(length_b)));
}

}  // namespace shardmerge
