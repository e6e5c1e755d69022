// Element casts as types, for the kernels: Cast<From, To>::apply turns one stored `From` element
// into one stored `To` element with shardmerge/convert.hpp's rounding rules, and visit_cast picks
// the operation for a runtime dtype pair. Kernels dispatch once per block and then loop over
// typed elements. Plain C++ as well (SM_HD), so tests/unit/test_kernel_math.cpp checks every
// pair against the CPU's convert_elements without a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "shardmerge/convert.hpp"
#include "shardmerge/dtype.hpp"

// Marks a __host__ __device__ template that calls the functor it is given: nvcc then accepts
// host-only functors (kernel launchers) where the template is instantiated for the host.
#ifdef __CUDACC__
#define SM_HD_VISITOR _Pragma("nv_exec_check_disable")
#else
#define SM_HD_VISITOR
#endif

namespace shardmerge::kernels {

// Bytes of one stored element; the same numbers as dtype_size(), which is host-only.
SM_HD int stored_bytes(DType t) {
  switch (t) {
    case DType::Bool:
    case DType::U8:
    case DType::I8:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
    case DType::F8_E8M0:
    case DType::F8_E4M3FNUZ:
    case DType::F8_E5M2FNUZ: return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32:
    case DType::C32: return 4;
    case DType::I64:
    case DType::U64:
    case DType::F64:
    case DType::C64: return 8;
    case DType::C128: return 16;
  }
  return 0;
}

// An element copied as it is, never interpreted: same-dtype copies of any dtype.
struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};
template <int N>
struct BitsOf;
template <>
struct BitsOf<1> {
  using type = uint8_t;
};
template <>
struct BitsOf<2> {
  using type = uint16_t;
};
template <>
struct BitsOf<4> {
  using type = uint32_t;
};
template <>
struct BitsOf<8> {
  using type = uint64_t;
};
template <>
struct BitsOf<16> {
  using type = Bytes16;
};

template <int N>
struct Copy {
  using In = typename BitsOf<N>::type;
  using Out = In;
  SM_HD static Out apply(In v) { return v; }
};

// double <-> float as the CPU's conversion instructions do it (round to nearest even; a NaN keeps
// its sign and the top of its payload, quieted). A GPU's cvt would canonicalise NaNs instead, so
// the NaN case is spelled out in bits.
SM_HD float f64_to_f32(uint64_t bits) {
  if ((bits & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull)
    return convert::bits_float(static_cast<uint32_t>(bits >> 32 & 0x80000000u) | 0x7FC00000u |
                               static_cast<uint32_t>(bits >> 29 & 0x3FFFFFu));
  double d;
  memcpy(&d, &bits, sizeof d);
  return static_cast<float>(d);
}
SM_HD uint64_t f32_to_f64(float f) {
  const uint32_t u = convert::float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint64_t>(u & 0x80000000u) << 32 | 0x7FF8000000000000ull | static_cast<uint64_t>(u & 0x3FFFFFu) << 29;
  const double d = f;
  uint64_t bits;
  memcpy(&bits, &d, sizeof bits);
  return bits;
}

// How each convertible dtype is stored (F64 as bits, so NaNs can be handled as above).
template <DType D>
struct StorageOf {
  using type = uint8_t;  // the float8 formats
};
template <>
struct StorageOf<DType::F32> {
  using type = uint32_t;
};
template <>
struct StorageOf<DType::BF16> {
  using type = uint16_t;
};
template <>
struct StorageOf<DType::F16> {
  using type = uint16_t;
};
template <>
struct StorageOf<DType::F64> {
  using type = uint64_t;
};

template <DType D>
SM_HD float to_float(typename StorageOf<D>::type v) {
  using namespace convert;
  if constexpr (D == DType::F32) return bits_float(v);
  else if constexpr (D == DType::BF16) return bf16_to_f32(v);
  else if constexpr (D == DType::F16) return f16_to_f32(v);
  else if constexpr (D == DType::F64) return f64_to_f32(v);
  else if constexpr (D == DType::F8_E4M3) return f8e4m3fn_to_f32(v);
  else if constexpr (D == DType::F8_E5M2) return f8e5m2_to_f32(v);
  else if constexpr (D == DType::F8_E4M3FNUZ) return f8e4m3fnuz_to_f32(v);
  else if constexpr (D == DType::F8_E5M2FNUZ) return f8e5m2fnuz_to_f32(v);
  else return f8e8m0_to_f32(v);
}

// Conversion between two different float dtypes, through float (to F64: widened from float).
template <DType From, DType To>
struct Cast {
  using In = typename StorageOf<From>::type;
  using Out = typename StorageOf<To>::type;
  SM_HD static Out apply(In v) {
    const float f = to_float<From>(v);
    if constexpr (To == DType::F64) return f32_to_f64(f);
    else if constexpr (To == DType::F32) return convert::float_bits(f);
    else if constexpr (To == DType::BF16) return convert::f32_to_bf16(f);
    else return convert::f32_to_f16(f);
  }
};

SM_HD_VISITOR
template <DType To, class F>
SM_HD bool visit_cast_from(DType from, F&& f) {
  switch (from) {
    case DType::F32: f(Cast<DType::F32, To>{}); return true;
    case DType::BF16: f(Cast<DType::BF16, To>{}); return true;
    case DType::F16: f(Cast<DType::F16, To>{}); return true;
    case DType::F64: f(Cast<DType::F64, To>{}); return true;
    case DType::F8_E4M3: f(Cast<DType::F8_E4M3, To>{}); return true;
    case DType::F8_E5M2: f(Cast<DType::F8_E5M2, To>{}); return true;
    case DType::F8_E4M3FNUZ: f(Cast<DType::F8_E4M3FNUZ, To>{}); return true;
    case DType::F8_E5M2FNUZ: f(Cast<DType::F8_E5M2FNUZ, To>{}); return true;
    case DType::F8_E8M0: f(Cast<DType::F8_E8M0, To>{}); return true;
    default: return false;
  }
}

// Calls f(op) with the operation that turns a `from` element into a `to` element: a bit copy
// when the dtypes are equal, else a Cast. False (and no call) for pairs that have none, the
// same pairs as can_convert() refuses.
SM_HD_VISITOR
template <class F>
SM_HD bool visit_cast(DType from, DType to, F&& f) {
  if (from == to) {
    switch (stored_bytes(from)) {
      case 1: f(Copy<1>{}); return true;
      case 2: f(Copy<2>{}); return true;
      case 4: f(Copy<4>{}); return true;
      case 8: f(Copy<8>{}); return true;
      case 16: f(Copy<16>{}); return true;
      default: return false;
    }
  }
  switch (to) {
    case DType::F32: return visit_cast_from<DType::F32>(from, f);
    case DType::BF16: return visit_cast_from<DType::BF16>(from, f);
    case DType::F16: return visit_cast_from<DType::F16>(from, f);
    case DType::F64: return visit_cast_from<DType::F64>(from, f);
    default: return false;
  }
}

// One element, by runtime dtypes: what a kernel thread does for one index.
SM_HD bool cast_element(const void* src, DType from, void* dst, DType to) {
  return visit_cast(from, to, [&](auto op) {
    using Op = decltype(op);
    typename Op::In v;
    memcpy(&v, src, sizeof v);
    const typename Op::Out out = Op::apply(v);
    memcpy(dst, &out, sizeof out);
  });
}

}  // namespace shardmerge::kernels
