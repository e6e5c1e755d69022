// Size flags (src/util/units.cpp, parse_size): text that is not a number is a usage error
// naming the text, never std::stod's own exception (which ended the process unexplained).
#include <gtest/gtest.h>

#include <string>

#include "shardmerge/error.hpp"
#include "util/units.hpp"

namespace shardmerge {
namespace {

TEST(Units, SizesParse) {
  EXPECT_EQ(parse_size("1.5GB"), 1500000000u);
  EXPECT_EQ(parse_size("500MiB"), 500u << 20);
  EXPECT_EQ(parse_size(".5KB"), 500u);
  EXPECT_EQ(parse_size("7"), 7u);
}

TEST(Units, TextThatIsNotANumberIsAUsageError) {
  for (const std::string text : {".", "..GB", "1.2.3GB", "GB", ""}) {
    try {
      parse_size(text);
      ADD_FAILURE() << "'" << text << "' parsed";
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), ExitCode::usage) << text;
      EXPECT_NE(std::string(e.what()).find("'" + text + "' is not a size"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardmerge
