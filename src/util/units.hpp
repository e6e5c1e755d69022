// Byte sizes for humans: "5GB" (decimal, as transformers) and "500MiB" (binary) in, "1.26 GB" out.
#pragma once

#include <cstdint>
#include <string>

namespace shardmerge {

// Accepts a plain number of bytes or a number with B/KB/MB/GB/TB (powers of 1000) or
// KiB/MiB/GiB/TiB (powers of 1024), case-insensitive, e.g. "5GB", "500MiB", "1.5gb".
uint64_t parse_size(const std::string& text);
std::string format_bytes(uint64_t bytes);             // "1.26 GB"
std::string format_rate(uint64_t bytes, double secs);  // "2.31 GB/s", "4.20 MB/s"

}  // namespace shardmerge
