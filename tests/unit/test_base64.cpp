// util/base64.hpp against RFC 4648's test vectors, and the texts it must refuse.
#include <gtest/gtest.h>

#include "util/base64.hpp"

namespace shardmerge {
namespace {

TEST(Base64, Rfc4648VectorsBothWays) {
  const std::pair<std::string, std::string> vectors[] = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                                                         {"foo", "Zm9v"},  {"foob", "Zm9vYg=="},  {"fooba", "Zm9vYmE="},
                                                         {"foobar", "Zm9vYmFy"}};
  for (const auto& [bytes, text] : vectors) {
    EXPECT_EQ(base64_encode(bytes), text);
    EXPECT_EQ(base64_decode(text), bytes);
  }
}

TEST(Base64, EveryByteValueRoundTrips) {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (size_t n = 0; n <= all.size(); n += 37) EXPECT_EQ(base64_decode(base64_encode(all.substr(0, n))), all.substr(0, n));
  EXPECT_EQ(base64_encode(std::string("\xff\xfe\x00", 3)), "//4A");
}

TEST(Base64, NonCanonicalTextIsRefused) {
  for (const char* bad : {"Zg=", "Zg", "Z===", "Zm9v=", "Zh==", "Zm9=", "Zg==Zg==", "Zm 9", "Zm9\n", "Z=g="})
    EXPECT_FALSE(base64_decode(bad)) << bad;
}

}  // namespace
}  // namespace shardmerge
