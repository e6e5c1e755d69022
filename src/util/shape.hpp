// Shapes: their element counts, and as text for messages ("[251, 32]").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardmerge/error.hpp"

namespace shardmerge {

inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Readers bound the shapes they accept, but a count that wrapped around would silently
// shrink a copy, so the product is checked anyway: a negative dimension or more than 2^64
// elements is an error, and an empty dimension makes 0 whatever the others are.
inline uint64_t element_count(const std::vector<int64_t>& shape) {
  for (int64_t d : shape)
    if (d < 0) throw Error("shape " + shape_string(shape) + " has a negative dimension");
  for (int64_t d : shape)
    if (d == 0) return 0;
  uint64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
      throw Error("shape " + shape_string(shape) + " has more than 2^64 elements");
  return n;
}

}  // namespace shardmerge
