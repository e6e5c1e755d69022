// Small string helpers shared by the name parsers.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace shardmerge {

// A non-negative decimal that spans all of `s` (digits only: no sign, no spaces), or nothing;
// also nothing when it does not fit int64_t.
inline std::optional<int64_t> parse_decimal(std::string_view s) {
  if (s.empty() || s.front() < '0' || s.front() > '9') return std::nullopt;
  int64_t v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

// `s` without leading and trailing spaces, tabs and line ends.
inline std::string_view trim_whitespace(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

}  // namespace shardmerge
