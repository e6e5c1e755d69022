// compare_elements: what `verify` and `diff` call equal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "verify/compare.hpp"

namespace shardmerge {
namespace {

const uint8_t* bytes(const float* f) { return reinterpret_cast<const uint8_t*>(f); }

TEST(CompareElements, BitwiseByDefaultSignedZerosDiffer) {
  const float a[] = {0.0f, 1.0f}, b[] = {-0.0f, 1.0f};
  const TensorDiff d = compare_elements(bytes(a), bytes(b), DType::F32, 2, 0.0);
  EXPECT_EQ(d.elements, 2u);
  EXPECT_EQ(d.mismatched, 1u);
  EXPECT_EQ(d.max_abs_error, 0.0);
}

TEST(CompareElements, NanEqualsNanEvenWithOtherPayload) {
  float a[] = {std::numeric_limits<float>::quiet_NaN()}, b[1];
  uint32_t bits = 0x7fc00123u;
  std::memcpy(b, &bits, 4);
  EXPECT_EQ(compare_elements(bytes(a), bytes(b), DType::F32, 1, 0.0).mismatched, 0u);
}

TEST(CompareElements, ToleranceAcceptsSmallErrorsAndReportsTheLargest) {
  const float a[] = {1.0f, 2.0f, 3.0f}, b[] = {1.001f, 2.0f, 3.5f};
  const TensorDiff d = compare_elements(bytes(a), bytes(b), DType::F32, 3, 0.01);
  EXPECT_EQ(d.mismatched, 1u);
  EXPECT_NEAR(d.max_abs_error, 0.5, 1e-6);
}

TEST(CompareElements, IntegersCompareExactly) {
  const int32_t a[] = {1, 2}, b[] = {1, 3};
  EXPECT_EQ(compare_elements(reinterpret_cast<const uint8_t*>(a), reinterpret_cast<const uint8_t*>(b), DType::I32, 2, 10.0)
                .mismatched,
            1u);
}

}  // namespace
}  // namespace shardmerge
