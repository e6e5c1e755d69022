// JSON text written directly, for the files planning writes entry by entry (a safetensors
// header, a model index): 100k entries built as json values cost more than the rest of planning.
#pragma once

#include <string>
#include <string_view>

namespace shardmerge {

// Appends `s` as a JSON string, byte for byte as nlohmann's dump() writes it (UTF-8 kept,
// quotes, backslashes and control characters escaped). Throws on invalid UTF-8, as dump() does.
void append_json_string(std::string& out, std::string_view s);

}  // namespace shardmerge
