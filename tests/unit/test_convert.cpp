// dtype conversion: the per-element rounding functions (shared with the CUDA kernels) and the
// CPU loops built on them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "exec/convert_cpu.hpp"
#include "shardmerge/convert.hpp"

namespace shardmerge {
namespace {

using namespace convert;

TEST(ConvertBf16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(bits_float(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(bits_float(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(bits_float(0x3F808001)), 0x3F81);  // above the tie
  EXPECT_EQ(f32_to_bf16(bits_float(0x3F807FFF)), 0x3F80);  // below the tie
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(bits_float(0x7F7FFFFF)), 0x7F80);  // FLT_MAX rounds to infinity, as torch
  EXPECT_EQ(f32_to_bf16(bits_float(0x00000001)), 0x0000);  // smallest subnormal rounds to zero
  EXPECT_EQ(f32_to_bf16(bits_float(0x80000000)), 0x8000);  // -0 keeps its sign
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(bits_float(0x7F800001)))));  // a NaN that would round to inf
}

TEST(ConvertBf16, EveryBf16RoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), h) << "bf16 0x" << std::hex << h;
  }
}

TEST(ConvertF16, EveryHalfRoundTripsAndMidpointsTieToEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << "half 0x" << std::hex << h;
    // Halfway to the next half (same sign, finite): ties go to the even mantissa.
    if ((h & 0x7FFF) < 0x7BFF) {
      const float next = f16_to_f32(static_cast<uint16_t>(h + 1));
      const double mid = (static_cast<double>(f) + static_cast<double>(next)) / 2;
      const float midf = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(midf), mid);  // representable in float
      const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
      ASSERT_EQ(f32_to_f16(midf), even) << "midpoint above half 0x" << std::hex << h;
    }
  }
}

TEST(ConvertF16, OverflowAndSubnormals) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);  // the tie above max rounds to infinity
  EXPECT_EQ(f32_to_f16(-1e10f), 0xFC00);
  EXPECT_EQ(f32_to_f16(5.9604644775390625e-8f), 0x0001);  // 2^-24, smallest subnormal
  EXPECT_EQ(f32_to_f16(2.98023223876953125e-8f), 0x0000); // 2^-25 ties to even (zero)
  EXPECT_EQ(f32_to_f16(8.940696716308594e-8f), 0x0002);   // 1.5 * 2^-24 ties to even (2)
}

TEST(ConvertFp8, DecodesKnownValues) {
  EXPECT_EQ(f8e4m3fn_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3fn_to_f32(0x7E), 448.0f);  // largest e4m3fn
  EXPECT_EQ(f8e4m3fn_to_f32(0x01), 0.001953125f);
  EXPECT_TRUE(std::isnan(f8e4m3fn_to_f32(0x7F)));
  EXPECT_EQ(f8e5m2_to_f32(0x3C), 1.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(f8e5m2_to_f32(0x7C)));
  EXPECT_EQ(f8e4m3fnuz_to_f32(0x40), 1.0f);
  EXPECT_TRUE(std::isnan(f8e4m3fnuz_to_f32(0x80)));
  EXPECT_EQ(f8e5m2fnuz_to_f32(0x40), 1.0f);
  EXPECT_EQ(f8e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(f8e8m0_to_f32(130), 8.0f);
  EXPECT_TRUE(std::isnan(f8e8m0_to_f32(0xFF)));
}

TEST(ConvertLoops, StridedAndBoxCopiesConvert) {
  const float src[6] = {1.0f, 2.0f, 3.0f, -1.0f, 0.5f, 65536.0f};
  uint16_t dst[3];
  convert_elements(src, DType::F32, 2, dst, DType::BF16, 3);
  EXPECT_EQ(dst[0], 0x3F80);
  EXPECT_EQ(dst[1], 0x4040);
  EXPECT_EQ(dst[2], 0x3F00);
  // A transposed 2x3 box: source strides (1, 2), destination row-major (3, 1).
  const int64_t s_strides[2] = {1, 2}, d_strides[2] = {3, 1}, extent[2] = {2, 3};
  float out[6];
  convert_box(src, DType::F32, s_strides, out, DType::F32, d_strides, extent, 2);
  const float expected[6] = {1.0f, 3.0f, 0.5f, 2.0f, -1.0f, 65536.0f};
  EXPECT_EQ(std::memcmp(out, expected, sizeof out), 0);
  uint16_t halves[6];
  convert_elements(src, DType::F32, 1, halves, DType::F16, 6);
  EXPECT_EQ(halves[5], 0x7C00);  // 65536 overflows fp16
  double wide[2];
  convert_elements(halves, DType::F16, 1, wide, DType::F64, 2);
  EXPECT_EQ(wide[1], 2.0);
}

TEST(ConvertLoops, FiniteCastFindsTheFirstNonFiniteAndStillCasts) {
  std::vector<float> src(1000, 1.5f);
  std::vector<uint16_t> out(src.size());
  EXPECT_EQ(convert_finite_f32(src.data(), out.data(), DType::BF16, src.size()), src.size());
  EXPECT_EQ(out[999], 0x3FC0);
  src[700] = -std::numeric_limits<float>::infinity();
  src[901] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(convert_finite_f32(src.data(), out.data(), DType::F16, src.size()), 700u);
  EXPECT_EQ(out[700], 0xFC00);
  EXPECT_EQ(out[0], 0x3E00);
  std::vector<float> same(src.size());
  EXPECT_EQ(convert_finite_f32(src.data() + 701, same.data(), DType::F32, 299), 200u);
  EXPECT_EQ(std::memcmp(same.data(), src.data() + 701, 299 * sizeof(float)), 0);
  double wide[2];
  EXPECT_EQ(convert_finite_f32(src.data() + 699, wide, DType::F64, 2), 1u);  // the fallback path checks too
  EXPECT_EQ(wide[0], 1.5);
}

TEST(ConvertLoops, IntegersAreNeverConverted) {
  EXPECT_TRUE(can_convert(DType::I64, DType::I64));
  EXPECT_FALSE(can_convert(DType::I64, DType::BF16));
  EXPECT_FALSE(can_convert(DType::F32, DType::I32));
  EXPECT_FALSE(can_convert(DType::F32, DType::F8_E4M3));  // never written
  EXPECT_TRUE(can_convert(DType::F8_E4M3, DType::BF16));
}

}  // namespace
}  // namespace shardmerge
