#include "util/json_text.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace shardmerge {

void append_json_string(std::string& out, std::string_view s) {
  // Tensor and file names are plain printable ASCII: copied as they are. Anything else goes
  // through nlohmann, so that the escapes are its own.
  const bool plain = std::all_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x7f && c != '"' && c != '\\';
  });
  if (!plain) {
    out += nlohmann::json(std::string(s)).dump();
    return;
  }
  out += '"';
  out += s;
  out += '"';
}

}  // namespace shardmerge
