// Element copies with dtype conversion on the CPU, built on the per-element functions of
// shardmerge/convert.hpp (shared with the CUDA kernels).
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardmerge/dtype.hpp"

namespace shardmerge {

// True when `from` can be converted to `to`: same dtype, or both floating point (complex
// excluded). Integer and bool tensors are never converted.
bool can_convert(DType from, DType to);

// n elements, source elements `src_stride` elements apart, destination dense.
void convert_elements(const void* src, DType from, int64_t src_stride, void* dst, DType to, size_t n);

// A box of `ndim` dims: element i is at src + sum(i_k * src_strides[k]) (elements of `from`) and
// dst + sum(i_k * dst_strides[k]) (elements of `to`); the innermost dst stride must be 1.
void convert_box(const void* src, DType from, const int64_t* src_strides, void* dst, DType to,
                 const int64_t* dst_strides, const int64_t* extent, size_t ndim);

// Converts n dense floats to `to` like convert_elements and returns the index of the first NaN
// or infinity among them, or n when all are finite: the check rides along the cast's one pass,
// and the position is looked up only when something is wrong.
size_t convert_finite_f32(const float* src, void* dst, DType to, size_t n);

}  // namespace shardmerge
