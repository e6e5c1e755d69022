// The arithmetic the CUDA kernels run, checked on the CPU against the CPU executor: every cast a
// kernel can do (kernels/cast.cuh) against convert_elements, the box index math
// (kernels/gather_box.cuh) against plain multi-index enumeration, and whole gathers, cut into
// fills exactly as the CUDA executor cuts them (exec/fill.hpp) and run element by element through
// the kernel's own per-thread function, against gather.cpp. Needs no GPU and no CUDA toolkit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "exec/convert_cpu.hpp"
#include "exec/fill.hpp"
#include "exec/gather.hpp"
#include "exec/tasks.hpp"
#include "kernels/cast.cuh"
#include "kernels/gather_box.cuh"
#include "test_support.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

const DType kAllDTypes[] = {DType::Bool,    DType::U8,      DType::I8,          DType::I16,        DType::U16,
                            DType::I32,     DType::U32,     DType::I64,         DType::U64,        DType::F16,
                            DType::BF16,    DType::F32,     DType::F64,         DType::C32,        DType::C64,
                            DType::C128,    DType::F8_E4M3, DType::F8_E5M2,     DType::F8_E8M0,    DType::F8_E4M3FNUZ,
                            DType::F8_E5M2FNUZ};
const DType kTargets[] = {DType::F32, DType::BF16, DType::F16, DType::F64};

// Source bit patterns for a dtype: all of them up to 16 bits, else the special values and many
// random patterns (NaNs with payloads, subnormals and infinities included).
std::vector<uint8_t> patterns(DType t) {
  const size_t size = dtype_size(t);
  std::vector<uint8_t> out;
  auto append = [&](const void* p) { out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + size); };
  if (size <= 2) {
    for (uint32_t v = 0; v < (1u << (8 * size)); ++v) append(&v);
    return out;
  }
  if (t == DType::F32)
    for (uint32_t v : {0x00000000u, 0x80000000u, 0x00000001u, 0x007FFFFFu, 0x00800000u, 0x3F800000u, 0x7F7FFFFFu,
                       0x7F800000u, 0xFF800000u, 0x7F800001u, 0x7FBFFFFFu, 0x7FC00000u, 0xFFC00001u, 0x477FF000u,
                       0x477FEFFFu, 0x38800000u, 0x387FFFFFu, 0x33000000u, 0x33000001u, 0x3F808000u, 0x3F818000u})
      append(&v);
  if (t == DType::F64)
    for (uint64_t v : {0x0ull, 0x8000000000000000ull, 0x1ull, 0x000FFFFFFFFFFFFFull, 0x3FF0000000000000ull,
                       0x7FEFFFFFFFFFFFFFull, 0x7FF0000000000000ull, 0xFFF0000000000000ull, 0x7FF0000000000001ull,
                       0x7FF8000000000000ull, 0xFFF7FFFFFFFFFFFFull, 0x47EFFFFFE0000000ull, 0x47EFFFFFF0000000ull,
                       0x36A0000000000000ull, 0x3FF0000010000000ull, 0x3FF0000030000000ull})
      append(&v);
  std::mt19937 rng(static_cast<uint32_t>(t) + 1);
  for (size_t i = 0; i < (size_t{1} << 20) * size; ++i) out.push_back(static_cast<uint8_t>(rng()));
  return out;
}

TEST(KernelCast, StoredBytesMatchTheDTypeTable) {
  for (DType t : kAllDTypes) EXPECT_EQ(kernels::stored_bytes(t), dtype_size(t)) << dtype_name(t);
}

TEST(KernelCast, ConvertsExactlyThePairsTheCpuConverts) {
  for (DType from : kAllDTypes)
    for (DType to : kAllDTypes)
      EXPECT_EQ(kernels::visit_cast(from, to, [](auto) {}), can_convert(from, to))
          << dtype_name(from) << " -> " << dtype_name(to);
}

// Every pair a kernel converts, bit for bit as the CPU executor, on every 8- and 16-bit pattern
// and a million wider ones; same-dtype copies of every dtype too.
TEST(KernelCast, EveryElementCastIsBitIdenticalToTheCpu) {
  for (DType from : kAllDTypes) {
    const std::vector<uint8_t> src = patterns(from);
    const size_t n = src.size() / dtype_size(from);
    for (DType to : kAllDTypes) {
      if (!can_convert(from, to)) continue;
      std::vector<uint8_t> cpu(n * dtype_size(to)), gpu(n * dtype_size(to), 0xA5);
      convert_elements(src.data(), from, 1, cpu.data(), to, n);
      for (size_t i = 0; i < n; ++i)
        ASSERT_TRUE(kernels::cast_element(src.data() + i * dtype_size(from), from, gpu.data() + i * dtype_size(to), to));
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(std::memcmp(cpu.data() + i * dtype_size(to), gpu.data() + i * dtype_size(to), dtype_size(to)), 0)
            << dtype_name(from) << " -> " << dtype_name(to) << " element " << i;
    }
  }
}

TEST(KernelCast, DoubleNansKeepSignAndPayloadAsTheCpuDoes) {
  // The GPU's own conversion instruction would give a canonical NaN here.
  EXPECT_EQ(convert::float_bits(kernels::f64_to_f32(0xFFF0000000000001ull)), 0xFFC00000u);
  EXPECT_EQ(convert::float_bits(kernels::f64_to_f32(0x7FF4000020000000ull)), 0x7FE00001u);
  EXPECT_EQ(kernels::f32_to_f64(convert::bits_float(0x7F800001u)), 0x7FF8000020000000ull);
  EXPECT_EQ(kernels::f32_to_f64(convert::bits_float(0xFFC00000u)), 0xFFF8000000000000ull);
}

// ---- index math ------------------------------------------------------------------------------

// Offsets of every element of a box by plain multi-index enumeration (row-major order).
std::vector<kernels::ElementOffsets> enumerate(const std::vector<int64_t>& extent, const std::vector<int64_t>& src,
                                               const std::vector<int64_t>& dst) {
  std::vector<kernels::ElementOffsets> out;
  std::vector<int64_t> idx(extent.size(), 0);
  uint64_t n = 1;
  for (int64_t e : extent) n *= static_cast<uint64_t>(e);
  for (uint64_t k = 0; k < n; ++k) {
    kernels::ElementOffsets o;
    for (size_t d = 0; d < extent.size(); ++d) {
      o.src += idx[d] * src[d];
      o.dst += idx[d] * dst[d];
    }
    out.push_back(o);
    for (size_t d = extent.size(); d-- > 0;) {
      if (++idx[d] < extent[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

TEST(KernelIndex, CoalescedBoxOffsetsEnumerateEveryShape) {
  // Every shape of up to 4 dims with extents 1..3, under row-major, transposed, padded and
  // interleaved strides: the kernel's offsets equal the enumeration, element by element.
  std::mt19937 rng(7);
  size_t merged = 0;
  for (size_t ndim = 0; ndim <= 4; ++ndim) {
    std::vector<int64_t> extent(ndim, 1);
    while (true) {
      for (int layout = 0; layout < 4; ++layout) {
        std::vector<int64_t> dst = row_major_strides(extent), src = dst;
        if (layout == 1) std::reverse(src.begin(), src.end());                         // transposed-like
        if (layout == 2) for (auto& s : src) s *= 2;                                   // every other element
        if (layout == 3) for (auto& s : src) s = std::uniform_int_distribution<int64_t>(1, 9)(rng);
        const auto want = enumerate(extent, src, dst);
        const kernels::BoxMap m = kernels::coalesce(extent.data(), src.data(), dst.data(), ndim);
        merged += ndim - static_cast<size_t>(m.ndim);
        for (uint64_t j = 0; j < want.size(); ++j) {
          const kernels::ElementOffsets got = kernels::box_offsets(m, j);
          ASSERT_EQ(got.src, want[j].src) << "ndim " << ndim << " layout " << layout << " element " << j;
          ASSERT_EQ(got.dst, want[j].dst) << "ndim " << ndim << " layout " << layout << " element " << j;
        }
      }
      size_t d = 0;
      while (d < ndim && ++extent[d] > 3) extent[d++] = 1;
      if (d == ndim) break;
    }
  }
  EXPECT_GT(merged, 0u);  // coalescing did merge dims
}

TEST(KernelIndex, CoalescingKeepsManyUnitDimsAndRefusesTooManyRealOnes) {
  std::vector<int64_t> extent(12, 1), strides(12, 1);
  extent[3] = 5;
  EXPECT_EQ(kernels::coalesce(extent.data(), strides.data(), strides.data(), 12).ndim, 1);
  std::vector<int64_t> e(kernels::kMaxBoxDims + 1, 2), s(e.size()), d(e.size());
  for (size_t k = 0; k < e.size(); ++k) s[k] = d[k] = static_cast<int64_t>(k + 1) * 1000;  // nothing merges
  EXPECT_THROW(kernels::coalesce(e.data(), s.data(), d.data(), e.size()), Error);
}

// ---- whole gathers: the CUDA executor's fills vs gather.cpp ----------------------------------

class KernelGather : public ::testing::Test {
 protected:
  test::TempDir dir;
  std::vector<std::string> contents;  // bytes of each source file
  std::vector<File> files;
  SourceFds fds;

  uint32_t add_source(DType dtype, size_t count, uint32_t seed) {
    std::mt19937 rng(seed);
    std::string bytes(count * dtype_size(dtype), '\0');
    for (size_t i = 0; i < count; ++i) {
      // Finite values of the dtype (random floats for float dtypes, random bits otherwise).
      const float f = std::uniform_real_distribution<float>(-3, 3)(rng);
      uint8_t* p = reinterpret_cast<uint8_t*>(bytes.data()) + i * dtype_size(dtype);
      if (is_floating(dtype) && can_convert(DType::F32, dtype)) {
        convert_elements(&f, DType::F32, 1, p, dtype, 1);
      } else {
        for (size_t b = 0; b < dtype_size(dtype); ++b) p[b] = static_cast<uint8_t>(rng());
      }
    }
    const std::string path = dir / ("src" + std::to_string(files.size()));
    File f = File::create(path);
    f.write_exact(0, bytes.data(), bytes.size());
    fds.fds.push_back(f.fd());
    fds.names.push_back(path);
    files.push_back(std::move(f));
    contents.push_back(std::move(bytes));
    return static_cast<uint32_t>(files.size() - 1);
  }

  // The box as the GPU builds it: regions cut to `capacity`, packed into fills, each fill's
  // bytes staged as the device receives them, then every region's elements through
  // copy_element, the kernel's per-thread step.
  std::vector<uint8_t> gpu_gather(const std::vector<Slice>& pieces, const Box& box, DType to, uint64_t capacity,
                                  size_t* fill_count) {
    std::vector<uint8_t> dst(box.numel() * dtype_size(to), 0xEE);
    const std::vector<int64_t> dst_strides = row_major_strides(box.extent);
    const std::vector<GatherRegion> regions = gather_regions(pieces, box, capacity);
    std::vector<uint64_t> staged((capacity + 7) / 8 + 2);  // 8-byte aligned, as device memory is (and more)
    for (size_t next = 0; next < regions.size(); ++*fill_count) {
      const Fill fill = pack_fill(regions, next, capacity, dst_strides, to);
      EXPECT_LE(fill.bytes, capacity);
      auto* bytes = reinterpret_cast<uint8_t*>(staged.data());
      for (const FillRead& r : fill.reads) std::memcpy(bytes + r.offset, contents[r.file].data() + r.file_offset, r.bytes);
      for (const kernels::RegionCopy& region : fill.regions)
        kernels::visit_cast(region.from, to, [&](auto op) {
          for (uint64_t j = 0; j < region.numel; ++j) kernels::copy_element<decltype(op)>(region, j, bytes, dst.data());
        });
    }
    return dst;
  }

  std::vector<uint8_t> cpu_gather(const std::vector<Slice>& pieces, const Box& box, DType to, uint64_t capacity) {
    std::vector<uint8_t> dst(box.numel() * dtype_size(to), 0x11), staging(capacity);
    Gatherer(fds, staging.data(), staging.size()).gather(pieces, box, dst.data(), to);
    return dst;
  }

  // Every slab box of `shape` at several slab sizes, staged at several capacities (from one
  // element to everything), to every target dtype.
  void check_tensor(const std::string& what, const std::vector<int64_t>& shape, const std::vector<Slice>& pieces) {
    uint64_t numel = 1, widest = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
    for (const Slice& s : pieces) widest = std::max<uint64_t>(widest, dtype_size(s.dtype));
    std::vector<DType> targets(std::begin(kTargets), std::end(kTargets));
    if (!is_floating(pieces.front().dtype)) targets = {pieces.front().dtype};
    size_t fills = 0;
    for (uint64_t slab : {uint64_t{1}, uint64_t{5}, numel / 3 + 1, numel})
      for (const Box& box : slab_boxes(shape, slab))
        for (uint64_t capacity : {widest, 3 * widest + 16, uint64_t{64}, numel * widest * 4})
          for (DType to : targets) {
            const auto gpu = gpu_gather(pieces, box, to, capacity, &fills);
            const auto cpu = cpu_gather(pieces, box, to, capacity);
            ASSERT_EQ(gpu, cpu) << what << ": box at " << box.start.size() << "-dim start, " << box.numel()
                                << " elements, capacity " << capacity << ", to " << dtype_name(to);
          }
    EXPECT_GT(fills, 0u) << what;
  }
};

Slice piece(uint32_t file, uint64_t offset, DType dtype, std::vector<int64_t> strides, std::vector<int64_t> start,
            std::vector<int64_t> extent) {
  return Slice{file, offset, dtype, std::move(strides), std::move(start), std::move(extent)};
}

TEST_F(KernelGather, FsdpAndTensorParallelConcatenationAlongEachDim) {
  // Two rank files each holding a [6, 5] block: concatenated along dim 0 ([12, 5]) and dim 1
  // ([6, 10]); the second rank is bf16 to mix dtypes inside one fill.
  const uint32_t a = add_source(DType::F32, 30, 1), b = add_source(DType::BF16, 30, 2);
  check_tensor("dim 0", {12, 5},
               {piece(a, 0, DType::F32, {5, 1}, {0, 0}, {6, 5}), piece(b, 0, DType::BF16, {5, 1}, {6, 0}, {6, 5})});
  check_tensor("dim 1", {6, 10},
               {piece(a, 0, DType::F32, {5, 1}, {0, 0}, {6, 5}), piece(b, 0, DType::BF16, {5, 1}, {0, 5}, {6, 5})});
}

TEST_F(KernelGather, TransposedAndPaddedSources) {
  // A [7, 4] tensor stored transposed (element (i, j) at i + 7 j), and one stored with padded
  // rows (stride 6 for 4 columns) at an odd byte offset.
  const uint32_t t = add_source(DType::F16, 28, 3), p = add_source(DType::F32, 50, 4);
  check_tensor("transposed", {7, 4}, {piece(t, 0, DType::F16, {1, 7}, {0, 0}, {7, 4})});
  check_tensor("padded", {7, 4}, {piece(p, 12, DType::F32, {6, 1}, {0, 0}, {7, 4})});
}

TEST_F(KernelGather, QkvDeInterleavingAndGateUpSplits) {
  // Megatron's fused QKV [heads * (q + k + v), hidden] with 2 kv groups of (2 q, 1 k, 1 v)
  // rows of 3: q is rows {0,1,4,5}, k is rows {2,6}, v is rows {3,7}, each group its own Slice.
  const uint32_t qkv = add_source(DType::BF16, 8 * 3, 5);
  std::vector<Slice> q, k, v;
  for (int64_t g = 0; g < 2; ++g) {
    q.push_back(piece(qkv, static_cast<uint64_t>(g * 4 * 3) * 2, DType::BF16, {3, 1}, {g * 2, 0}, {2, 3}));
    k.push_back(piece(qkv, static_cast<uint64_t>((g * 4 + 2) * 3) * 2, DType::BF16, {3, 1}, {g, 0}, {1, 3}));
    v.push_back(piece(qkv, static_cast<uint64_t>((g * 4 + 3) * 3) * 2, DType::BF16, {3, 1}, {g, 0}, {1, 3}));
  }
  check_tensor("q", {4, 3}, q);
  check_tensor("k", {2, 3}, k);
  check_tensor("v", {2, 3}, v);
  // A fused gate_up [2 * 5, 4] split into gate (first 5 rows) and up (last 5), and a [4, 2 * 3]
  // fused along columns split into two [4, 3] halves (strided rows).
  const uint32_t gu = add_source(DType::F32, 40, 6), cols = add_source(DType::F32, 24, 7);
  check_tensor("gate", {5, 4}, {piece(gu, 0, DType::F32, {4, 1}, {0, 0}, {5, 4})});
  check_tensor("up", {5, 4}, {piece(gu, 5 * 4 * 4, DType::F32, {4, 1}, {0, 0}, {5, 4})});
  check_tensor("right half", {4, 3}, {piece(cols, 3 * 4, DType::F32, {6, 1}, {0, 0}, {4, 3})});
}

TEST_F(KernelGather, ThreeDimsScalarsFp8AndIntegers) {
  // [3, 4, 5] concatenated along dim 1 from two ranks whose blocks are stored [2, 3, 5] / [2, 3, 5]
  // transposed in their first two dims; a scalar; an fp8 source; an int64 tensor (copied as is).
  const uint32_t r0 = add_source(DType::F32, 30, 8), r1 = add_source(DType::F64, 30, 9);
  check_tensor("3-d", {3, 4, 5},
               {piece(r0, 0, DType::F32, {5, 15, 1}, {0, 0, 0}, {3, 2, 5}),
                piece(r1, 0, DType::F64, {5, 15, 1}, {0, 2, 0}, {3, 2, 5})});
  const uint32_t s = add_source(DType::BF16, 1, 10);
  check_tensor("scalar", {}, {piece(s, 0, DType::BF16, {}, {}, {})});
  const uint32_t f8 = add_source(DType::F8_E4M3, 35, 11);
  check_tensor("fp8", {5, 7}, {piece(f8, 0, DType::F8_E4M3, {1, 5}, {0, 0}, {5, 7})});
  const uint32_t ints = add_source(DType::I64, 12, 12);
  check_tensor("int64", {4, 3}, {piece(ints, 0, DType::I64, {1, 4}, {0, 0}, {4, 3})});
}

TEST_F(KernelGather, FillsHoldAtMostOneLaunchOfRegions) {
  // A transposed source staged one element per region: thousands of regions, cut into fills of
  // at most kMaxRegionsPerLaunch, still equal to the CPU's gather.
  const uint32_t t = add_source(DType::F32, 64 * 40, 13);
  const std::vector<Slice> pieces = {piece(t, 0, DType::F32, {1, 64}, {0, 0}, {64, 40})};
  const Box box{{0, 0}, {64, 40}};
  const std::vector<GatherRegion> regions = gather_regions(pieces, box, 4);
  ASSERT_EQ(regions.size(), 64u * 40u);
  size_t next = 0, fills = 0;
  while (next < regions.size()) {
    const Fill fill = pack_fill(regions, next, 1 << 20, row_major_strides(box.extent), DType::BF16);
    EXPECT_LE(fill.regions.size(), kernels::kMaxRegionsPerLaunch);
    ++fills;
  }
  EXPECT_EQ(fills, 3u);
  EXPECT_EQ(gpu_gather(pieces, box, DType::BF16, 4, &fills), cpu_gather(pieces, box, DType::BF16, 4));
}

}  // namespace
}  // namespace shardmerge
