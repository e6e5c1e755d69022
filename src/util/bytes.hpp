// Little-endian loads and stores on unaligned byte buffers.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace shardmerge {

template <typename T>
inline T load_le(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // every supported target is little-endian
  return v;
}

template <typename T>
inline void append_le(std::string& out, T v) {
  char buf[sizeof v];
  std::memcpy(buf, &v, sizeof v);
  out.append(buf, sizeof v);
}

}  // namespace shardmerge
