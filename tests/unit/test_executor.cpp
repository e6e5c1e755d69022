// Task decomposition and the CPU executor on hand-made source files: every output byte is
// written exactly once, from the right source bytes, converted as planned, within the budget.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "exec/tasks.hpp"
#include "formats/hf_index.hpp"
#include "shardmerge/convert.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "verify/compare.hpp"
#include "write/hf_tree_writer.hpp"
#include "formats/safetensors.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

TEST(Tasks, BoxContiguity) {
  EXPECT_TRUE(box_is_contiguous({2, 8}, {10, 8}));
  EXPECT_TRUE(box_is_contiguous({1, 1, 5}, {4, 3, 8}));
  EXPECT_TRUE(box_is_contiguous({1, 3, 8}, {4, 3, 8}));
  EXPECT_FALSE(box_is_contiguous({2, 4}, {10, 8}));
  EXPECT_FALSE(box_is_contiguous({1, 2, 4}, {4, 3, 8}));
  EXPECT_EQ(linear_index({2, 3}, {10, 8}), 19u);
}

TEST(Tasks, SlabBoxesTileTheTensorWithinTheBudget) {
  for (const auto& [shape, budget] : std::vector<std::pair<std::vector<int64_t>, uint64_t>>{
           {{10, 8}, 16}, {{3, 5, 7}, 6}, {{3, 5, 7}, 1000}, {{1, 100}, 7}, {{7}, 3}, {{}, 1}}) {
    std::vector<int> hits(static_cast<size_t>(std::max<int64_t>(1, [&] {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      return n;
    }())), 0);
    for (const Box& b : slab_boxes(shape, budget)) {
      EXPECT_LE(b.numel(), std::max<uint64_t>(budget, 1));
      EXPECT_TRUE(box_is_contiguous(b.extent, shape));
      const uint64_t first = linear_index(b.start, shape);
      for (uint64_t i = 0; i < b.numel(); ++i) hits.at(first + i)++;
    }
    for (int h : hits) ASSERT_EQ(h, 1) << "shape rank " << shape.size() << " budget " << budget;
  }
}

// A row-major float32 matrix written to a file, so pieces can point into it.
struct SourceMatrix {
  std::string path;
  std::vector<float> values;
};

SourceMatrix write_matrix(const std::string& path, size_t n, uint32_t seed) {
  SourceMatrix m{path, std::vector<float>(n)};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2, 2);
  for (auto& v : m.values) v = dist(rng);
  File f = File::create(path);
  f.write_exact(0, m.values.data(), n * 4);
  return m;
}

Slice slice(uint32_t file, uint64_t offset, std::vector<int64_t> strides, std::vector<int64_t> start,
            std::vector<int64_t> extent) {
  return Slice{file, offset, DType::F32, std::move(strides), std::move(start), std::move(extent)};
}

class Executor : public ::testing::Test {
 protected:
  TempDir dir;
  // Two "rank files" each holding a 6x4 local block of a 12x4 (Shard 0) and of a 4x12 (Shard 1)
  // global matrix, plus a transposed 4x6 view.
  SourceMatrix r0 = write_matrix(dir / "r0.bin", 48, 1);
  SourceMatrix r1 = write_matrix(dir / "r1.bin", 48, 2);

  MergePlan plan(DType out) {
    std::vector<SourceFile> sources = {{r0.path, 48 * 4, {}}, {r1.path, 48 * 4, {}}};
    OutputTensor dim0{"dim0", out, {12, 4}, 0, 0, 0, {}, std::nullopt, ""};
    dim0.copies = {slice(0, 0, {4, 1}, {0, 0}, {6, 4}), slice(1, 0, {4, 1}, {6, 0}, {6, 4})};
    OutputTensor dim1{"dim1", out, {4, 12}, 0, 0, 0, {}, std::nullopt, ""};
    dim1.copies = {slice(0, 96, {6, 1}, {0, 0}, {4, 6}), slice(1, 96, {6, 1}, {0, 6}, {4, 6})};
    OutputTensor tr{"transposed", out, {6, 4}, 0, 0, 0, {}, std::nullopt, ""};
    tr.copies = {slice(0, 0, {1, 6}, {0, 0}, {6, 4})};  // element (i, j) at i + 6 j
    return test::one_file_plan({dim0, dim1, tr}, sources);
  }

  // Expected global values of each tensor, computed directly from the source arrays.
  float expect(const std::string& name, int64_t i, int64_t j) const {
    if (name == "dim0") return (i < 6 ? r0 : r1).values[static_cast<size_t>((i % 6) * 4 + j)];
    if (name == "dim1") return (j < 6 ? r0 : r1).values[static_cast<size_t>(24 + i * 6 + j % 6)];
    return r0.values[static_cast<size_t>(i + 6 * j)];
  }

  void check_output(const std::string& out_dir, DType dtype) {
    HfWeights w = open_hf_weights(out_dir);
    File f = File::open_read(w.path_of(w.tensors.at("dim0")));
    for (const char* name : {"dim0", "dim1", "transposed"}) {
      const SafetensorsTensor& t = *w.tensors.at(name).tensor;
      ASSERT_EQ(t.dtype, dtype);
      std::string bytes = f.read_string(t.file_offset, t.nbytes);
      for (int64_t i = 0; i < t.shape[0]; ++i)
        for (int64_t j = 0; j < t.shape[1]; ++j) {
          const size_t k = static_cast<size_t>(i * t.shape[1] + j);
          const float want = expect(name, i, j);
          if (dtype == DType::F32) {
            float got;
            std::memcpy(&got, bytes.data() + k * 4, 4);
            ASSERT_EQ(got, want) << name << "[" << i << "," << j << "]";
          } else {
            uint16_t got;
            std::memcpy(&got, bytes.data() + k * 2, 2);
            ASSERT_EQ(got, convert::f32_to_bf16(want)) << name << "[" << i << "," << j << "]";
          }
        }
    }
  }
};

TEST_F(Executor, ConcatenatesAlongAnyDimAndCasts) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const MergePlan p = plan(dtype);
    // dim0 is direct runs, dim1 and the transposed view need slabs.
    const auto tasks = make_tasks(p, TaskLimits{32, 32});
    size_t runs = 0, slabs = 0;
    for (const Task& t : tasks) (t.kind == Task::Kind::Run ? runs : slabs)++;
    EXPECT_GE(runs, 2u);
    EXPECT_GE(slabs, 2u);
    const std::string out = dir / (std::string("out_") + std::string(dtype_name(dtype)));
    HfTreeWriter writer(out, false, dir / "src");
    writer.create(p);
    ExecOptions opt;
    opt.threads = 2;
    const ExecStats stats = make_cpu_executor()->run(p, writer, opt);
    writer.commit(p);
    EXPECT_EQ(stats.bytes_written, p.bytes_written() - p.files[0].header.size());
    check_output(out, dtype);
  }
}

// The Python API's Ctrl-C: a cancel flag set mid-run stops the executor at its next task, the run
// throws, and the writer, never committed, leaves neither the target nor its temp directory.
TEST_F(Executor, CancelStopsAtTheNextTaskAndLeavesNoOutput) {
  const MergePlan p = plan(DType::F32);
  const std::string parent = dir / "cancelled";
  const std::string out = parent + "/model";
  std::atomic<bool> cancel{false};
  std::atomic<uint64_t> written{0};
  ExecOptions opt;
  opt.threads = 1;
  opt.cancel = &cancel;
  opt.on_written = [&](uint64_t n) {
    written += n;
    cancel = true;  // after the first task's bytes
  };
  {
    HfTreeWriter writer(out, false, "");
    writer.create(p);
    try {
      make_cpu_executor()->run(p, writer, opt);
      FAIL() << "a cancelled run returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.message(), "cancelled");
    }
  }
  EXPECT_GT(written.load(), 0u);
  EXPECT_LT(written.load(), p.bytes_written() - p.files[0].header.size());
  EXPECT_FALSE(std::filesystem::exists(parent));  // the parent it created is gone too
}

TEST_F(Executor, VerifySinkFindsTheOneChangedByte) {
  const MergePlan p = plan(DType::BF16);
  const std::string out = dir / "out";
  {
    HfTreeWriter writer(out, false, "");
    writer.create(p);
    make_cpu_executor()->run(p, writer, ExecOptions{});
    writer.commit(p);
  }
  {
    HfWeights w = open_hf_weights(out);
    CompareSink sink(p, w, 0);
    make_cpu_executor()->run(p, sink, ExecOptions{});
    EXPECT_TRUE(sink.result().equal());
  }
  // Flip one byte of "dim1": verify names that tensor and only it.
  HfWeights w = open_hf_weights(out);
  const auto& t = *w.tensors.at("dim1").tensor;
  {
    std::fstream f(w.path_of(w.tensors.at("dim1")), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(t.file_offset + 5));
    f.put('\x7f');
  }
  HfWeights tampered = open_hf_weights(out);
  CompareSink sink(p, tampered, 0);
  make_cpu_executor()->run(p, sink, ExecOptions{});
  const TreeDiff d = sink.result();
  EXPECT_FALSE(d.equal());
  EXPECT_EQ(d.values.at("dim1").mismatched, 1u);
  EXPECT_EQ(d.values.at("dim0").mismatched, 0u);
}

TEST_F(Executor, FoldsLoraInFp32) {
  // W [6, 4] from r0, A [2, 4] and B [6, 2] from r1; scale 0.5. And the transposed form.
  std::vector<SourceFile> sources = {{r0.path, 48 * 4, {}}, {r1.path, 48 * 4, {}}};
  OutputTensor w{"w", DType::F32, {6, 4}, 0, 0, 0, {slice(0, 0, {4, 1}, {0, 0}, {6, 4})}, std::nullopt, ""};
  w.lora = LoraFold{{slice(1, 0, {4, 1}, {0, 0}, {2, 4})}, {slice(1, 32, {2, 1}, {0, 0}, {6, 2})}, 2, 0.5, false};
  OutputTensor wt{"wt", DType::F32, {4, 6}, 0, 0, 0, {slice(0, 0, {6, 1}, {0, 0}, {4, 6})}, std::nullopt, ""};
  wt.lora = LoraFold{{slice(1, 0, {4, 1}, {0, 0}, {2, 4})}, {slice(1, 32, {2, 1}, {0, 0}, {6, 2})}, 2, 0.5, true};
  const MergePlan p = test::one_file_plan({w, wt}, sources);
  const std::string out = dir / "fold";
  HfTreeWriter writer(out, false, "");
  writer.create(p);
  const ExecStats stats = make_cpu_executor()->run(p, writer, ExecOptions{});
  writer.commit(p);
  EXPECT_EQ(stats.lora_folds, 2u);
  HfWeights result = open_hf_weights(out);
  File f = File::open_read(result.path_of(result.tensors.at("w")));
  const auto* A = r1.values.data();        // [2, 4]
  const auto* B = r1.values.data() + 8;    // [6, 2]
  for (const char* name : {"w", "wt"}) {
    const auto& t = *result.tensors.at(name).tensor;
    std::vector<float> got(t.nbytes / 4);
    f.read_exact(t.file_offset, got.data(), t.nbytes);
    for (int o = 0; o < 6; ++o)
      for (int i = 0; i < 4; ++i) {
        double delta = 0;
        for (int k = 0; k < 2; ++k) delta += static_cast<double>(B[o * 2 + k]) * A[k * 4 + i];
        const bool tr = std::string(name) == "wt";
        const size_t at = tr ? static_cast<size_t>(i * 6 + o) : static_cast<size_t>(o * 4 + i);
        const double want = r0.values[at] + 0.5 * delta;
        EXPECT_NEAR(got[at], want, 1e-5) << name << " out " << o << " in " << i;
      }
  }
}

TEST_F(Executor, RefusesSourcesThatChangedAndBudgetsTooSmall) {
  MergePlan p = plan(DType::BF16);
  p.sources[1].size += 4;
  HfTreeWriter writer(dir / "out", false, "");
  writer.create(p);
  try {
    make_cpu_executor()->run(p, writer, ExecOptions{});
    FAIL() << "a source whose size changed must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed since the plan"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("r1.bin"), std::string::npos);
  }
  ExecOptions tiny;
  tiny.memory_limit = 1 << 20;
  EXPECT_THROW(make_cpu_executor()->run(plan(DType::BF16), writer, tiny), Error);
}

TEST_F(Executor, WriterIsAtomicAndRefusesUnsafeTargets) {
  const MergePlan p = plan(DType::BF16);
  const std::string out = dir / "atomic";
  std::string temp;
  {
    HfTreeWriter writer(out, false, "");
    writer.create(p);
    temp = writer.temp_dir();
    EXPECT_TRUE(std::filesystem::exists(temp));
    EXPECT_FALSE(std::filesystem::exists(out));
    // No commit: as if the merge failed.
  }
  EXPECT_FALSE(std::filesystem::exists(temp));
  EXPECT_FALSE(std::filesystem::exists(out));

  std::filesystem::create_directories(out);
  { std::ofstream(out + "/old.txt") << "old"; }
  EXPECT_THROW(HfTreeWriter(out, false, ""), Error);
  {
    HfTreeWriter writer(out, true, "");
    writer.create(p);
    make_cpu_executor()->run(p, writer, ExecOptions{});
    writer.commit(p);
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/old.txt"));
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  std::filesystem::create_directories(dir / "src/actor");
  EXPECT_THROW(HfTreeWriter(dir / "src/actor/hf", false, dir / "src"), Error);
}

}  // namespace
}  // namespace shardmerge
