// Base64 (RFC 4648, standard alphabet, padded): bytes that are not text, such as a safetensors
// header's binary length prefix, carried byte-exact inside a JSON string.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace shardmerge {

std::string base64_encode(std::string_view bytes);
// The bytes `text` encodes, or nothing when it is not canonical padded base64 (a character
// outside the alphabet, a length not a multiple of 4, misplaced padding, non-zero spare bits).
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace shardmerge
