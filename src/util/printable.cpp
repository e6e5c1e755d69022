#include "util/printable.hpp"

#include <cstdint>
#include <cstdio>

namespace shardmerge {
namespace {

// Length of the valid UTF-8 sequence starting at s[i] (overlongs, surrogates and code points
// above U+10FFFF are invalid), or 0.
size_t utf8_length(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  size_t n;
  uint32_t cp;
  if (b0 < 0x80) return 1;
  if ((b0 & 0xE0) == 0xC0) n = 2, cp = b0 & 0x1F;
  else if ((b0 & 0xF0) == 0xE0) n = 3, cp = b0 & 0x0F;
  else if ((b0 & 0xF8) == 0xF0) n = 4, cp = b0 & 0x07;
  else return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

}  // namespace

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<uint8_t>(text[i]);
    const size_t n = utf8_length(text, i);
    if (n == 0 || b < 0x20 || b == 0x7F) {
      char esc[5];
      std::snprintf(esc, sizeof esc, "\\x%02x", b);
      out += esc;
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace shardmerge
