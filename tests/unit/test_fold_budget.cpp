// The CPU executor's fold memory budget must never wait for memory its own worker holds: two
// LoRA folds of increasing size on one thread, under a limit that holds either fold's working
// set but not both, must finish (a worker that kept its old scratch while asking for a larger
// one waited forever). Runs in a child process with an alarm, so a hang fails the test instead
// of blocking the suite.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <random>
#include <vector>

#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "util/rss.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

constexpr int64_t kCols = 16384;
constexpr int64_t kRows = 32;
constexpr uint64_t kMiB = 1ull << 20;

// What the executor writes, per output file; unwritten bytes stay zero.
class MemorySink : public OutputSink {
 public:
  explicit MemorySink(const MergePlan& plan) {
    for (const OutputFile& f : plan.files) files_.emplace_back(f.size, 0);
  }
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override {
    std::memcpy(files_[file].data() + offset, data, n);
  }
  float at(const OutputTensor& t, int64_t i, int64_t j) const {
    float v;
    std::memcpy(&v, files_[t.file].data() + t.offset + static_cast<uint64_t>(i * t.shape[1] + j) * 4, 4);
    return v;
  }

 private:
  mutable std::vector<std::vector<uint8_t>> files_;
};

Slice rows_of(uint64_t offset, int64_t rows, int64_t cols) {
  return Slice{0, offset, DType::F32, {cols, 1}, {0, 0}, {rows, cols}};
}

// W [kRows, kCols] += 0.5 * B [kRows, rank] @ A [rank, kCols], all read from one file at `at`.
struct Fold {
  int64_t rank;
  uint64_t w_at, a_at, b_at;
};

// Runs both folds on one thread with --memory-limit leaving 16 MiB beyond the baseline
// (staging 2 x 4 MiB, fold budget 8 MiB): the first fold keeps 3.5 MiB of scratch, the second
// needs 6 MiB. Exits 0 when every checked element equals the fold computed here in double.
[[noreturn]] void fold_twice_on_one_thread(const std::string& dir) {
  const std::vector<Fold> folds = [] {
    std::vector<Fold> f;
    uint64_t at = 0;
    for (int64_t rank : {56, 96}) {
      Fold x{rank, at, 0, 0};
      x.a_at = x.w_at + kRows * kCols * 4;
      x.b_at = x.a_at + static_cast<uint64_t>(rank * kCols) * 4;
      at = x.b_at + static_cast<uint64_t>(kRows * rank) * 4;
      f.push_back(x);
    }
    return f;
  }();
  const uint64_t bytes = folds.back().b_at + static_cast<uint64_t>(kRows * folds.back().rank) * 4;
  std::vector<float> values(bytes / 4);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (float& v : values) v = dist(rng);
  const std::string path = dir + "/src.bin";
  File::create(path).write_exact(0, values.data(), bytes);

  std::vector<OutputTensor> tensors;
  for (const Fold& f : folds) {
    std::string name = "w";  // (built in steps: GCC 12 warns falsely on "w" + string)
    name += std::to_string(f.rank);
    OutputTensor w{name, DType::F32, {kRows, kCols}, 0, 0, 0, {rows_of(f.w_at, kRows, kCols)},
                   std::nullopt, ""};
    w.lora = LoraFold{{rows_of(f.a_at, f.rank, kCols)}, {rows_of(f.b_at, kRows, f.rank)}, f.rank, 0.5, false};
    tensors.push_back(w);
  }
  const MergePlan plan = test::one_file_plan(tensors, {SourceFile{path, bytes, std::nullopt}});
  MemorySink sink(plan);
  ExecOptions opt;
  opt.threads = 1;
  opt.memory_limit = current_rss_bytes() + 64 * kMiB + 16 * kMiB;
  ::alarm(30);
  try {
    make_cpu_executor()->run(plan, sink, opt);
  } catch (const Error& e) {
    std::fprintf(stderr, "merge failed: %s\n", e.what());
    std::_Exit(2);
  }
  for (size_t k = 0; k < folds.size(); ++k) {
    const Fold& f = folds[k];
    for (int64_t i : {int64_t{0}, kRows / 2, kRows - 1})
      for (int64_t j : {int64_t{0}, int64_t{1234}, kCols - 1}) {
        double want = values[(f.w_at / 4) + static_cast<size_t>(i * kCols + j)];
        for (int64_t r = 0; r < f.rank; ++r)
          want += 0.5 * static_cast<double>(values[f.b_at / 4 + static_cast<size_t>(i * f.rank + r)]) *
                  values[f.a_at / 4 + static_cast<size_t>(r * kCols + j)];
        const float got = sink.at(plan.tensors[k], i, j);
        if (std::abs(got - want) > 1e-4) {
          std::fprintf(stderr, "%s[%ld, %ld] = %g, want %g\n", plan.tensors[k].name.c_str(), static_cast<long>(i),
                       static_cast<long>(j), static_cast<double>(got), want);
          std::_Exit(3);
        }
      }
  }
  std::_Exit(0);
}

TEST(FoldBudget, LargerFoldOnOneThreadUnderATightLimitFinishes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempDir dir;
  EXPECT_EXIT(fold_twice_on_one_thread(dir.path().string()), ::testing::ExitedWithCode(0), "")
      << "killed by SIGALRM (14) means the second fold waited for memory forever";
}

}  // namespace
}  // namespace shardmerge
