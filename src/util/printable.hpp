// Text from untrusted files (tensor names, record names, parser excerpts) made safe for one
// terminal line: valid UTF-8 is kept, control characters and invalid bytes become \xNN.
#pragma once

#include <string>
#include <string_view>

namespace shardmerge {

std::string printable(std::string_view text);

}  // namespace shardmerge
