// Per-element dtype conversion, bit-identical to torch's `tensor.to(dtype)` on finite values.
// These are the only implementation of the rounding rules: the CPU executor's loops and the
// CUDA cast kernel both call them, so CPU unit tests cover the GPU arithmetic too.
//
// Rounding: float -> bf16/fp16 is round-to-nearest-even, as torch's c10::BFloat16/c10::Half.
// Wider types go through float first (torch converts double -> bf16 via float, too).
// NaN stays NaN (bf16 gets torch's scalar canonical 0x7FC0, fp16 the quiet NaN 0x7E00 with
// its sign); torch's vectorised paths may pick other NaN payloads, so compare NaNs as NaNs.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SM_HD __host__ __device__ __forceinline__
#else
#define SM_HD inline
#endif

namespace shardmerge::convert {

SM_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
SM_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// ---- to float ------------------------------------------------------------------------------

SM_HD float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

SM_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(mag));
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float8 formats (decode only: shardmerge never writes fp8 it did not read).
// e4m3fn: bias 7, no infinities, S.1111.111 is NaN.
SM_HD float f8e4m3fn_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if (exp == 0xF && mant == 0x7) return bits_float(sign | 0x7FC00000u);
  if (exp == 0) return bits_float(sign | float_bits(static_cast<float>(mant) * 0.001953125f));  // 2^-9
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}
// e5m2: the top byte of an IEEE half.
SM_HD float f8e5m2_to_f32(uint8_t b) { return f16_to_f32(static_cast<uint16_t>(b) << 8); }
// e4m3fnuz / e5m2fnuz: biases 8 / 16, no infinities, no negative zero, 0x80 is the only NaN.
SM_HD float f8e4m3fnuz_to_f32(uint8_t b) {
  if (b == 0x80) return bits_float(0x7FC00000u);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if (exp == 0) return bits_float(sign | float_bits(static_cast<float>(mant) * 0.0009765625f));  // 2^-10
  return bits_float(sign | ((exp + 119u) << 23) | (mant << 20));
}
SM_HD float f8e5m2fnuz_to_f32(uint8_t b) {
  if (b == 0x80) return bits_float(0x7FC00000u);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 2) & 0x1Fu;
  const uint32_t mant = b & 0x3u;
  if (exp == 0) return bits_float(sign | float_bits(static_cast<float>(mant) * 7.62939453125e-6f));  // 2^-17
  return bits_float(sign | ((exp + 111u) << 23) | (mant << 21));
}
// e8m0fnu: an unsigned power of two, 0xFF is NaN.
SM_HD float f8e8m0_to_f32(uint8_t b) {
  if (b == 0xFF) return bits_float(0x7FC00000u);
  if (b == 0) return bits_float(0x00400000u);  // 2^-127 is a float subnormal
  return bits_float(static_cast<uint32_t>(b) << 23);
}

// ---- from float ----------------------------------------------------------------------------

SM_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

SM_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (mag >= 0x477FF000u) return sign | 0x7C00u;  // rounds to infinity (>= 65520)
  if (mag < 0x38800000u) {
    // Result is a half subnormal (or zero): adding 0.5f, whose ulp is 2^-24, makes the FPU
    // round |f| to a multiple of 2^-24 with ties to even; the low bits are then the half.
    const float sum = bits_float(mag) + 0.5f;
    return sign | static_cast<uint16_t>(float_bits(sum) - 0x3F000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10, ties to even.
  const uint32_t odd = (mag >> 13) & 1u;
  mag += 0xC8000000u + 0xFFFu + odd;  // 0xC8000000 == (uint32_t)(-112 << 23)
  return sign | static_cast<uint16_t>(mag >> 13);
}

}  // namespace shardmerge::convert
