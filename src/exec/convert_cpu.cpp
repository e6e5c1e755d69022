#include "exec/convert_cpu.hpp"

#include <cstring>

#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge {
namespace {

using namespace convert;

// The cast loops are built for AVX-512 and AVX2 as well as the baseline, and the loader picks
// the best the CPU has (an fp32 -> bf16 cast runs 1.9x faster with AVX-512 than with the
// baseline SSE2). The loops must be inlined into the cloned functions to be built for them.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDMERGE_CAST_CLONES __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
#else
#define SHARDMERGE_CAST_CLONES
#endif

template <typename U>
U load_raw(const uint8_t* p) {
  U v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename U>
void store_raw(uint8_t* p, U v) {
  std::memcpy(p, &v, sizeof v);
}

float load_float(DType t, const uint8_t* p) {
  switch (t) {
    case DType::F32: return bits_float(load_raw<uint32_t>(p));
    case DType::BF16: return bf16_to_f32(load_raw<uint16_t>(p));
    case DType::F16: return f16_to_f32(load_raw<uint16_t>(p));
    case DType::F64: return static_cast<float>(load_raw<double>(p));
    case DType::F8_E4M3: return f8e4m3fn_to_f32(*p);
    case DType::F8_E5M2: return f8e5m2_to_f32(*p);
    case DType::F8_E4M3FNUZ: return f8e4m3fnuz_to_f32(*p);
    case DType::F8_E5M2FNUZ: return f8e5m2fnuz_to_f32(*p);
    case DType::F8_E8M0: return f8e8m0_to_f32(*p);
    default: throw Error("internal: no float load for " + std::string(dtype_name(t)));
  }
}

// The hot pairs get their own loops so the compiler can vectorise them.
template <typename In, typename Out, typename F>
[[gnu::always_inline]] inline void loop(const uint8_t* src, int64_t stride, uint8_t* dst, size_t n, F f) {
  const size_t step = sizeof(In) * static_cast<size_t>(stride);
  if (stride == 1) {
    for (size_t i = 0; i < n; ++i) store_raw<Out>(dst + i * sizeof(Out), f(load_raw<In>(src + i * sizeof(In))));
  } else {
    for (size_t i = 0; i < n; ++i) store_raw<Out>(dst + i * sizeof(Out), f(load_raw<In>(src + i * step)));
  }
}

uint32_t is_non_finite(uint32_t f32_bits) { return static_cast<uint32_t>((f32_bits & 0x7F800000u) == 0x7F800000u); }

// Casts and checks in one pass with no early exit, so that it vectorises. The flag is a local
// of its own function: were it the caller's, the byte stores could alias it and the loop
// would not vectorise.
template <typename Out, typename F>
[[gnu::always_inline]] inline uint32_t cast_checked(const float* src, uint8_t* dst, size_t n, F f) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = float_bits(src[i]);
    any |= is_non_finite(u);
    store_raw<Out>(dst + i * sizeof(Out), f(u));
  }
  return any;
}

}  // namespace

bool can_convert(DType from, DType to) {
  if (from == to) return true;
  auto convertible = [](DType t) { return is_floating(t) && t != DType::C32 && t != DType::C64 && t != DType::C128; };
  return convertible(from) && convertible(to) && to != DType::F8_E4M3 && to != DType::F8_E5M2 &&
         to != DType::F8_E8M0 && to != DType::F8_E4M3FNUZ && to != DType::F8_E5M2FNUZ;
}

SHARDMERGE_CAST_CLONES void convert_elements(const void* src_v, DType from, int64_t src_stride, void* dst_v, DType to, size_t n) {
  const auto* src = static_cast<const uint8_t*>(src_v);
  auto* dst = static_cast<uint8_t*>(dst_v);
  const size_t in = dtype_size(from), out = dtype_size(to);
  if (from == to) {
    if (src_stride == 1) {
      std::memcpy(dst, src, n * in);
    } else {
      for (size_t i = 0; i < n; ++i) std::memcpy(dst + i * out, src + i * in * static_cast<size_t>(src_stride), in);
    }
    return;
  }
  if (!can_convert(from, to))
    throw Error("cannot convert " + std::string(dtype_name(from)) + " to " + std::string(dtype_name(to)));
  if (from == DType::F32 && to == DType::BF16)
    return loop<uint32_t, uint16_t>(src, src_stride, dst, n, [](uint32_t u) { return f32_to_bf16(bits_float(u)); });
  if (from == DType::F32 && to == DType::F16)
    return loop<uint32_t, uint16_t>(src, src_stride, dst, n, [](uint32_t u) { return f32_to_f16(bits_float(u)); });
  if (from == DType::BF16 && to == DType::F32)
    return loop<uint16_t, uint32_t>(src, src_stride, dst, n, [](uint16_t h) { return float_bits(bf16_to_f32(h)); });
  if (from == DType::F16 && to == DType::F32)
    return loop<uint16_t, uint32_t>(src, src_stride, dst, n, [](uint16_t h) { return float_bits(f16_to_f32(h)); });
  if (to == DType::F64) {
    // Widening to double is exact from every other float type.
    for (size_t i = 0; i < n; ++i)
      store_raw<double>(dst + i * out, static_cast<double>(load_float(from, src + i * in * static_cast<size_t>(src_stride))));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float f = load_float(from, src + i * in * static_cast<size_t>(src_stride));
    switch (to) {
      case DType::F32: store_raw<uint32_t>(dst + i * out, float_bits(f)); break;
      case DType::BF16: store_raw<uint16_t>(dst + i * out, f32_to_bf16(f)); break;
      case DType::F16: store_raw<uint16_t>(dst + i * out, f32_to_f16(f)); break;
      default: throw Error("internal: no float store for " + std::string(dtype_name(to)));
    }
  }
}

SHARDMERGE_CAST_CLONES size_t convert_finite_f32(const float* src, void* dst_v, DType to, size_t n) {
  auto* dst = static_cast<uint8_t*>(dst_v);
  uint32_t any = 0;
  switch (to) {
    case DType::F32: any = cast_checked<uint32_t>(src, dst, n, [](uint32_t u) { return u; }); break;
    case DType::BF16: any = cast_checked<uint16_t>(src, dst, n, [](uint32_t u) { return f32_to_bf16(bits_float(u)); }); break;
    case DType::F16: any = cast_checked<uint16_t>(src, dst, n, [](uint32_t u) { return f32_to_f16(bits_float(u)); }); break;
    default:
      convert_elements(src, DType::F32, 1, dst, to, n);
      for (size_t i = 0; i < n; ++i) any |= is_non_finite(float_bits(src[i]));
  }
  if (!any) return n;
  for (size_t i = 0; i < n; ++i)
    if (is_non_finite(float_bits(src[i]))) return i;
  return n;
}

void convert_box(const void* src, DType from, const int64_t* src_strides, void* dst, DType to, const int64_t* dst_strides,
                 const int64_t* extent, size_t ndim) {
  if (ndim == 0) return convert_elements(src, from, 1, dst, to, 1);
  if (ndim == 1) return convert_elements(src, from, src_strides[0], dst, to, static_cast<size_t>(extent[0]));
  const size_t in = dtype_size(from), out = dtype_size(to);
  for (int64_t i = 0; i < extent[0]; ++i)
    convert_box(static_cast<const uint8_t*>(src) + static_cast<size_t>(i * src_strides[0]) * in, from, src_strides + 1,
                static_cast<uint8_t*>(dst) + static_cast<size_t>(i * dst_strides[0]) * out, to, dst_strides + 1, extent + 1,
                ndim - 1);
}

}  // namespace shardmerge
