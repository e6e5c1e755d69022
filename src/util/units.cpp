#include "util/units.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>

#include "shardmerge/error.hpp"

namespace shardmerge {

uint64_t parse_size(const std::string& text) {
  size_t pos = 0, digits = 0, dots = 0;
  for (; pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.'); ++pos)
    ++(text[pos] == '.' ? dots : digits);
  // std::stod would throw its own context-free exception for "." or "1.2.3".
  if (digits == 0 || dots > 1) throw usage_error("'" + text + "' is not a size (examples: 5GB, 500MiB, 1073741824)");
  const double number = std::stod(text.substr(0, pos));
  std::string unit;
  for (size_t i = pos; i < text.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(text[i]))) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kb" || unit == "k") scale = 1e3;
  else if (unit == "mb" || unit == "m") scale = 1e6;
  else if (unit == "gb" || unit == "g") scale = 1e9;
  else if (unit == "tb" || unit == "t") scale = 1e12;
  else if (unit == "kib") scale = 1024.0;
  else if (unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else throw usage_error("unknown size unit '" + unit + "' in '" + text + "' (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
  const double bytes = std::floor(number * scale);
  if (!(bytes >= 0) || bytes > 1.8e19) throw usage_error("size '" + text + "' is out of range");
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1000 && u < 5) {
    v /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string format_rate(uint64_t bytes, double secs) {
  if (secs <= 0) return "- B/s";
  return format_bytes(static_cast<uint64_t>(static_cast<double>(bytes) / secs)) + "/s";
}

}  // namespace shardmerge
