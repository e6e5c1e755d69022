// The CUDA executor against the CPU executor on small plans over temp files: copies, casts and
// gathers byte for byte, LoRA folds within an output ulp, errors with the same words, one GPU
// or several. Built only with SHARDMERGE_HAVE_CUDA; a test that needs a GPU skips, saying why,
// where none is usable.
#ifdef SHARDMERGE_HAVE_CUDA

#include <gtest/gtest.h>
#include <zstd.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "exec/convert_cpu.hpp"
#include "exec/cuda/cuda_executor.hpp"
#include "exec/tasks.hpp"
#include "formats/hf_index.hpp"
#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "verify/compare.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

#define REQUIRE_CUDA_DEVICES(n)                                                                            \
  do {                                                                                                     \
    const CudaDevices present = probe_cuda_devices();                                                      \
    if (present.count == 0) GTEST_SKIP() << "no CUDA device: " << present.unavailable;                     \
    if (present.count < (n))                                                                               \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, this machine has " << present.count;             \
  } while (0)

// What an executor writes, per output file, over a poison byte: bytes nobody wrote keep it.
class MemorySink : public OutputSink {
 public:
  MemorySink(const MergePlan& plan, uint8_t poison) {
    for (const OutputFile& f : plan.files) files_.emplace_back(f.size, poison);
  }
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override {
    std::memcpy(files_[file].data() + offset, data, n);
  }
  // The bytes of one planned tensor.
  std::vector<uint8_t> tensor(const OutputTensor& t) const {
    const auto& f = files_[t.file];
    return {f.begin() + static_cast<std::ptrdiff_t>(t.offset), f.begin() + static_cast<std::ptrdiff_t>(t.offset + t.nbytes)};
  }

 private:
  mutable std::vector<std::vector<uint8_t>> files_;
};

struct Outputs {
  MemorySink cpu, gpu;
};

// Options for the CUDA executor: --memory-limit counts its CUDA contexts and cuBLAS (several
// hundred MiB, exec/cuda/host_memory.hpp), more than the default 512 MiB leaves with folds.
ExecOptions gpu_options() {
  ExecOptions o;
  o.memory_limit = uint64_t{4} << 30;
  return o;
}

// Runs the plan on the CPU and on the GPU(s), each into its own differently poisoned sink.
Outputs run_both(const MergePlan& plan, std::unique_ptr<Executor> gpu) {
  Outputs o{MemorySink(plan, 0x5A), MemorySink(plan, 0xA5)};
  const ExecStats cpu_stats = make_cpu_executor()->run(plan, o.cpu, ExecOptions{});
  const ExecStats gpu_stats = gpu->run(plan, o.gpu, gpu_options());
  EXPECT_EQ(gpu_stats.bytes_read, cpu_stats.bytes_read);
  EXPECT_EQ(gpu_stats.bytes_written, cpu_stats.bytes_written);
  EXPECT_EQ(gpu_stats.lora_folds, cpu_stats.lora_folds);
  return o;
}

class CudaExecutorTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::vector<SourceFile> sources;

  // A source file of `count` random finite values of `dtype` (random bits for other dtypes).
  uint32_t add_source(DType dtype, size_t count, uint32_t seed, float range = 3) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> bytes(count * dtype_size(dtype));
    for (size_t i = 0; i < count; ++i) {
      const float f = std::uniform_real_distribution<float>(-range, range)(rng);
      uint8_t* p = bytes.data() + i * dtype_size(dtype);
      if (can_convert(DType::F32, dtype)) {
        convert_elements(&f, DType::F32, 1, p, dtype, 1);
      } else {
        for (size_t b = 0; b < dtype_size(dtype); ++b) p[b] = static_cast<uint8_t>(rng());
      }
    }
    const std::string path = dir / ("src" + std::to_string(sources.size()));
    File::create(path).write_exact(0, bytes.data(), bytes.size());
    sources.push_back({path, bytes.size(), {}});
    return static_cast<uint32_t>(sources.size() - 1);
  }

  static Slice piece(uint32_t file, uint64_t offset, DType dtype, std::vector<int64_t> strides, std::vector<int64_t> start,
                     std::vector<int64_t> extent) {
    return Slice{file, offset, dtype, std::move(strides), std::move(start), std::move(extent)};
  }
  static OutputTensor tensor(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<Slice> copies) {
    OutputTensor t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.copies = std::move(copies);
    return t;
  }

  // Every way the planner lays tensors out, large enough that a small --gpu-memory cuts each into
  // many fills: FSDP dim-0 runs, TP dim-1 slabs, a transposed source, QKV de-interleaving, f64,
  // fp8 and integer sources, a scalar.
  MergePlan mixed_plan(DType out) {
    const uint32_t r0 = add_source(DType::F32, 300 * 256, 1), r1 = add_source(DType::F32, 300 * 256, 2);
    const uint32_t t0 = add_source(DType::BF16, 256 * 200, 3), t1 = add_source(DType::BF16, 256 * 200, 4);
    const uint32_t tr = add_source(DType::F16, 300 * 128, 5), qkv = add_source(DType::BF16, 8 * 4 * 64 * 96, 6);
    const uint32_t f64 = add_source(DType::F64, 100 * 50, 7), f8 = add_source(DType::F8_E4M3, 64 * 64, 8);
    const uint32_t ints = add_source(DType::I64, 1000, 9), scalar = add_source(DType::BF16, 1, 10);
    std::vector<OutputTensor> tensors;
    tensors.push_back(tensor("dim0", out, {600, 256},
                             {piece(r0, 0, DType::F32, {256, 1}, {0, 0}, {300, 256}),
                              piece(r1, 0, DType::F32, {256, 1}, {300, 0}, {300, 256})}));
    tensors.push_back(tensor("dim1", out, {256, 400},
                             {piece(t0, 0, DType::BF16, {200, 1}, {0, 0}, {256, 200}),
                              piece(t1, 0, DType::BF16, {200, 1}, {0, 200}, {256, 200})}));
    tensors.push_back(tensor("transposed", out, {300, 128}, {piece(tr, 0, DType::F16, {1, 300}, {0, 0}, {300, 128})}));
    // k of a fused [groups * (2 q + k + v) * head_dim, hidden] QKV: 8 groups of 4 rows of 64
    std::vector<Slice> k;
    for (int64_t g = 0; g < 8; ++g)
      k.push_back(piece(qkv, static_cast<uint64_t>((g * 4 + 2) * 64 * 96) * 2, DType::BF16, {96, 1}, {g * 64, 0}, {64, 96}));
    tensors.push_back(tensor("k_proj", out, {512, 96}, k));
    tensors.push_back(tensor("f64", out, {100, 50}, {piece(f64, 0, DType::F64, {50, 1}, {0, 0}, {100, 50})}));
    tensors.push_back(tensor("fp8", out, {64, 64}, {piece(f8, 0, DType::F8_E4M3, {64, 1}, {0, 0}, {64, 64})}));
    tensors.push_back(tensor("ints", DType::I64, {1000}, {piece(ints, 0, DType::I64, {1}, {0}, {1000})}));
    tensors.push_back(tensor("scalar", out, {}, {piece(scalar, 0, DType::BF16, {}, {}, {})}));
    return test::one_file_plan(std::move(tensors), sources);
  }

  // W (bf16 source) + 0.5 * B @ A with A [16, in], B [out, 16] (fp32), plain and fan_in_fan_out.
  // `infinite_at`: only the plain tensor, with W infinite at that [row, col].
  MergePlan lora_plan(DType out, std::optional<std::pair<int64_t, int64_t>> infinite_at = std::nullopt) {
    const int64_t rows = 384, cols = 320, rank = 16;
    const uint32_t w = add_source(DType::BF16, rows * cols, 11), a = add_source(DType::F32, rank * cols, 12);
    const uint32_t b = add_source(DType::F32, rows * rank, 13), at = add_source(DType::F32, rank * rows, 14);
    const uint32_t bt = add_source(DType::F32, cols * rank, 15);
    OutputTensor plain = tensor("plain", out, {rows, cols}, {piece(w, 0, DType::BF16, {cols, 1}, {0, 0}, {rows, cols})});
    plain.lora = LoraFold{{piece(a, 0, DType::F32, {cols, 1}, {0, 0}, {rank, cols})},
                          {piece(b, 0, DType::F32, {rank, 1}, {0, 0}, {rows, rank})}, rank, 0.5, false};
    if (infinite_at) {
      const uint16_t inf = 0x7F80;
      File f = File::create(sources[w].path, true);
      std::vector<uint16_t> values(static_cast<size_t>(rows * cols), 0x3F80);
      values[static_cast<size_t>(infinite_at->first * cols + infinite_at->second)] = inf;
      f.write_exact(0, values.data(), values.size() * 2);
      return test::one_file_plan({plain}, sources);
    }
    // fan_in_fan_out: W stored [in = rows, out = cols]; A [rank, in], B [out, rank].
    OutputTensor fifo = tensor("fan_in_fan_out", out, {rows, cols}, {piece(w, 0, DType::BF16, {cols, 1}, {0, 0}, {rows, cols})});
    fifo.lora = LoraFold{{piece(at, 0, DType::F32, {rows, 1}, {0, 0}, {rank, rows})},
                         {piece(bt, 0, DType::F32, {rank, 1}, {0, 0}, {cols, rank})}, rank, 0.5, true};
    return test::one_file_plan({plain, fifo}, sources);
  }
};

void expect_identical(const MergePlan& plan, const Outputs& o) {
  for (const OutputTensor& t : plan.tensors) {
    const auto cpu = o.cpu.tensor(t), gpu = o.gpu.tensor(t);
    ASSERT_EQ(cpu.size(), gpu.size());
    size_t differ = 0, first = cpu.size();
    for (size_t i = 0; i < cpu.size(); ++i)
      if (cpu[i] != gpu[i] && differ++ == 0) first = i;
    EXPECT_EQ(differ, 0u) << t.name << ": " << differ << " of " << cpu.size() << " bytes differ, first at byte " << first;
  }
}

// Fold outputs: within one bf16 ulp of the CPU's, or within 1e-5 where the sum cancels to a
// value so small that the fp32 products' rounding (about 1e-6 here: 16 terms of up to 4.5) is
// more than an ulp. The two BLAS libraries sum in different orders; nothing else differs.
void expect_fold_agrees(const MergePlan& plan, const Outputs& o) {
  for (const OutputTensor& t : plan.tensors) {
    const auto cpu = o.cpu.tensor(t), gpu = o.gpu.tensor(t);
    const size_t size = dtype_size(t.dtype), n = cpu.size() / size;
    std::vector<float> a(n), b(n);
    convert_elements(cpu.data(), t.dtype, 1, a.data(), DType::F32, n);
    convert_elements(gpu.data(), t.dtype, 1, b.data(), DType::F32, n);
    size_t outside = 0, first = n;
    for (size_t i = 0; i < n; ++i) {
      const float bf16_ulp = std::ldexp(1.0f, std::ilogb(a[i]) - 7);
      if (!(std::fabs(a[i] - b[i]) <= std::max(bf16_ulp, 1e-5f)) && outside++ == 0) first = i;
    }
    EXPECT_EQ(outside, 0u) << t.name << " (" << dtype_name(t.dtype) << "): " << outside << " of " << n
                           << " values differ by more than a bf16 ulp, first at " << first << ": CPU " << a[first]
                           << ", GPU " << b[first];
  }
}

TEST(CudaTasks, SplitByBytesKeepsOrderAndBalances) {
  MergePlan plan;
  OutputTensor t;
  t.dtype = DType::BF16;
  t.shape = {1 << 20};
  plan.tensors.push_back(t);
  std::vector<Task> tasks;
  std::mt19937 rng(1);
  for (int i = 0; i < 200; ++i) {
    Task task;
    task.src_dtype = DType::F32;
    task.count = std::uniform_int_distribution<uint64_t>(1, 1000)(rng);
    task.src_offset = static_cast<uint64_t>(i);
    tasks.push_back(task);
  }
  for (size_t parts : {1, 2, 3, 8}) {
    const auto split = split_by_bytes(plan, tasks, parts);
    ASSERT_EQ(split.size(), parts);
    uint64_t expected = 0, total = 0, largest = 0, biggest_task = 0;
    for (const Task& task : tasks) {
      total += task_bytes(plan, task);
      biggest_task = std::max(biggest_task, task_bytes(plan, task));
    }
    for (const auto& part : split) {
      uint64_t bytes = 0;
      for (const Task& task : part) {
        EXPECT_EQ(task.src_offset, expected++);  // consecutive, in order
        bytes += task_bytes(plan, task);
      }
      largest = std::max(largest, bytes);
    }
    EXPECT_EQ(expected, tasks.size());
    EXPECT_LE(largest, total / parts + biggest_task) << parts << " parts";
  }
}

TEST_F(CudaExecutorTest, CopiesCastsAndGathersAreByteIdenticalToTheCpu) {
  REQUIRE_CUDA_DEVICES(1);
  for (DType out : {DType::BF16, DType::F32, DType::F16, DType::F64}) {
    const MergePlan plan = mixed_plan(out);
    // 1 MiB of GPU memory: 64 KiB fills, so every tensor takes many; then the default budget.
    for (uint64_t gpu_memory : {uint64_t{1} << 20, uint64_t{0}}) {
      SCOPED_TRACE(std::string(dtype_name(out)) + ", --gpu-memory " + std::to_string(gpu_memory));
      expect_identical(plan, run_both(plan, make_cuda_executor({0}, gpu_memory)));
    }
  }
}

TEST_F(CudaExecutorTest, LoraFoldsAgreeWithTheCpuWithinAnUlp) {
  REQUIRE_CUDA_DEVICES(1);
  for (DType out : {DType::BF16, DType::F32}) {
    const MergePlan plan = lora_plan(out);
    // 6 MiB: cuBLAS's workspace and slabs of about 150 rows, so each tensor folds in several.
    for (uint64_t gpu_memory : {uint64_t{6} << 20, uint64_t{0}}) {
      SCOPED_TRACE(std::string(dtype_name(out)) + ", --gpu-memory " + std::to_string(gpu_memory));
      expect_fold_agrees(plan, run_both(plan, make_cuda_executor({0}, gpu_memory)));
    }
  }
}

TEST_F(CudaExecutorTest, NonFiniteFoldFailsWithTheCpusMessage) {
  REQUIRE_CUDA_DEVICES(1);
  // Row 200 is in a later slab than the first on both executors (6 MiB: slabs of ~150 rows).
  const MergePlan plan = lora_plan(DType::BF16, std::pair<int64_t, int64_t>{200, 7});
  std::string cpu_error, gpu_error;
  MemorySink sink(plan, 0);
  try {
    make_cpu_executor()->run(plan, sink, ExecOptions{});
  } catch (const Error& e) {
    cpu_error = e.what();
  }
  try {
    make_cuda_executor({0}, uint64_t{6} << 20)->run(plan, sink, gpu_options());
  } catch (const Error& e) {
    gpu_error = e.what();
  }
  EXPECT_EQ(cpu_error, "tensor 'plain': LoRA fold produced a non-finite value at [200, 7]");
  EXPECT_EQ(gpu_error, cpu_error);
}

TEST_F(CudaExecutorTest, SeveralGpusShareThePlan) {
  REQUIRE_CUDA_DEVICES(2);
  const MergePlan plan = mixed_plan(DType::BF16);
  expect_identical(plan, run_both(plan, make_cuda_executor({0, 1}, uint64_t{1} << 20)));
  const MergePlan folds = lora_plan(DType::BF16);
  expect_fold_agrees(folds, run_both(folds, make_cuda_executor({1, 0}, 0)));
}

TEST_F(CudaExecutorTest, CompressedSourcesGiveTheBytesOfTheirUncompressedFiles) {
  REQUIRE_CUDA_DEVICES(1);
  // Each source file of the mixed plan stored as one zstd frame inside another file; the
  // oracle is the CPU executor on the uncompressed files.
  const MergePlan plain = mixed_plan(DType::BF16);
  MergePlan packed = plain;
  for (size_t i = 0; i < packed.sources.size(); ++i) {
    SourceFile& s = packed.sources[i];
    const std::string data = test::read_file(s.path);
    std::string frame(ZSTD_compressBound(data.size()), '\0');
    frame.resize(ZSTD_compress(frame.data(), frame.size(), data.data(), data.size(), 3));
    const std::string bytes = "prefix" + frame + "suffix";
    s.path = dir / ("packed" + std::to_string(i) + ".distcp");
    File::create(s.path).write_exact(0, bytes.data(), bytes.size());
    s.compressed = CompressedItem{"zstd", 6, frame.size(), data.size()};
    s.size = bytes.size();
  }
  MemorySink want(plain, 0);
  make_cpu_executor()->run(plain, want, ExecOptions{});
  const Outputs o = run_both(packed, make_cuda_executor({0}, uint64_t{1} << 20));
  for (const OutputTensor& t : plain.tensors) {
    EXPECT_TRUE(o.gpu.tensor(t) == want.tensor(t)) << t.name;
    EXPECT_TRUE(o.cpu.tensor(t) == want.tensor(t)) << t.name;
  }
}

TEST_F(CudaExecutorTest, WritesATreeThatVerifiesAndComparesThroughTheVerifySink) {
  REQUIRE_CUDA_DEVICES(1);
  const MergePlan plan = mixed_plan(DType::F32);  // f32 sources to f32: file-to-file copies too
  const std::string out = dir / "out";
  auto gpu = make_cuda_executor({}, 0);
  {
    HfTreeWriter writer(out, false, "");
    writer.create(plan);
    gpu->run(plan, writer, gpu_options());
    writer.commit(plan);
  }
  HfWeights written = open_hf_weights(out);
  auto cpu = make_cpu_executor();
  for (Executor* e : {cpu.get(), gpu.get()}) {
    CompareSink sink(plan, written, 0);
    e->run(plan, sink, gpu_options());
    EXPECT_TRUE(sink.result().equal()) << e->name();
  }
}

TEST_F(CudaExecutorTest, RefusesBudgetsTooSmallChangedSourcesAndMissingDevices) {
  REQUIRE_CUDA_DEVICES(1);
  MergePlan plan = mixed_plan(DType::BF16);
  MemorySink sink(plan, 0);
  try {
    make_cuda_executor({0}, 64 << 10)->run(plan, sink, gpu_options());
    FAIL() << "64 KiB of GPU memory cannot hold the staging buffers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--gpu-memory"), std::string::npos) << e.what();
  }
  ExecOptions tiny;
  tiny.memory_limit = 1 << 20;
  try {
    make_cuda_executor({0}, 0)->run(plan, sink, tiny);
    FAIL() << "1 MiB of host memory cannot hold a CUDA context";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA context"), std::string::npos) << e.what();
  }
  plan.sources[1].size += 1;
  try {
    make_cuda_executor({0}, 0)->run(plan, sink, gpu_options());
    FAIL() << "a source whose size changed must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed since the plan"), std::string::npos) << e.what();
  }
  const int count = probe_cuda_devices().count;
  EXPECT_THROW(make_cuda_executor({count}, 0), Error);
  EXPECT_THROW(make_cuda_executor({0, 0}, 0), Error);
}

}  // namespace
}  // namespace shardmerge

#endif  // SHARDMERGE_HAVE_CUDA
