#include <gtest/gtest.h>

#include "util/printable.hpp"

namespace shardmerge {
namespace {

TEST(Printable, KeepsAsciiAndValidUtf8) {
  EXPECT_EQ(printable("model.layers.0.weight"), "model.layers.0.weight");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
}

TEST(Printable, EscapesControlCharactersSoAMessageStaysOneLine) {
  EXPECT_EQ(printable("a\nb\rc\td\x1b[2J\x7f"), "a\\x0ab\\x0dc\\x09d\\x1b[2J\\x7f");
  EXPECT_EQ(printable(std::string_view("x\0y", 3)), "x\\x00y");
}

TEST(Printable, EscapesInvalidUtf8ByteByByte) {
  EXPECT_EQ(printable("siz\xcf_4"), "siz\\xcf_4");            // lead byte without continuation
  EXPECT_EQ(printable("\x80"), "\\x80");                      // lone continuation byte
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");             // overlong '/'
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");    // UTF-16 surrogate
  EXPECT_EQ(printable("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // above U+10FFFF
  EXPECT_EQ(printable("\xe2\x82"), "\\xe2\\x82");             // cut short at the end
}

}  // namespace
}  // namespace shardmerge
