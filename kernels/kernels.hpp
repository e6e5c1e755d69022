// The host side of the kernels: one launcher per op, enqueued on the caller's stream. Each
// checks its launch and throws shardmerge::Error; none synchronises.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/gather_box.cuh"
#include "shardmerge/dtype.hpp"

namespace shardmerge::kernels {

// cast.cu: n contiguous elements of `from` at `src` to `to` at `dst` (device pointers).
void launch_cast(const void* src, DType from, void* dst, DType to, uint64_t n, cudaStream_t stream);

// gather_box.cu: `count` regions (device array `regions`, at most kMaxRegionsPerLaunch) from the
// staged bytes at `staged` into the destination box at `dst`, cast to `to`. `max_numel` is the
// largest region's element count (sizes the grid).
void launch_gather_box(const RegionCopy* regions, uint32_t count, uint64_t max_numel, const uint8_t* staged, void* dst,
                       DType to, cudaStream_t stream);

// lora_fold.cu: W [rows, cols] (fp32, row-major) += scale * the LoRA product, exactly as the CPU
// executor's fold_task slices it:
//   plain:          W += scale * B_rows [rows, rank] @ A [rank, cols]
//   fan_in_fan_out: W += scale * A_cols^T [rows, rank] @ B^T [rank, cols]   (W stored [in, out])
struct LoraProduct {
  bool fan_in_fan_out = false;
  int64_t rows = 0, cols = 0, rank = 0;
  float scale = 0;
  const float* part = nullptr;      // plain: B rows [rows, rank]; fan_in_fan_out: A columns [rank, rows]
  const float* resident = nullptr;  // plain: A [rank, cols];        fan_in_fan_out: B [cols, rank]
  float* w = nullptr;
};
// On the handle's stream.
void lora_accumulate(cublasHandle_t handle, const LoraProduct& p);
// Casts the folded fp32 W to `to` and stores the smallest index of a non-finite value in
// *first_nonfinite, which the caller sets to UINT64_MAX first.
void launch_finite_cast(const float* w, uint64_t n, void* dst, DType to, unsigned long long* first_nonfinite,
                        cudaStream_t stream);

}  // namespace shardmerge::kernels
