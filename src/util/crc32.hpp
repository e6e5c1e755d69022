// CRC-32 (IEEE, as zip uses). The checksum is ISA-L's (carry-less multiply, AVX-512 where the
// CPU has it: ~35 GB/s per core against 16 for libdeflate and 3.4 for zlib), so checking every
// byte a merge reads costs little beside the reads themselves; combining comes from zlib.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardmerge {

// Incremental: crc32_update(0, ...) starts a new checksum.
uint32_t crc32_update(uint32_t crc, const void* data, size_t n);

// The CRC-32 of A followed by B, from crc(A), crc(B) and B's length (zlib's crc32_combine).
uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

}  // namespace shardmerge
