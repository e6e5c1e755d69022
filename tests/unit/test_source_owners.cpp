// Executors open only the source files their tasks read (exec/tasks.cpp source_files_read,
// exec/sources.cpp), and refuse a file that the plan gives to another process. The oracle for
// output bytes is the source arrays themselves, written here.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>

#include "exec/dist/partition.hpp"
#include "exec/tasks.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

Slice f32_slice(uint32_t file, uint64_t offset, std::vector<int64_t> strides, std::vector<int64_t> start,
                std::vector<int64_t> extent) {
  return Slice{file, offset, DType::F32, std::move(strides), std::move(start), std::move(extent)};
}

OutputTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, std::vector<Slice> copies) {
  OutputTensor t;
  t.name = name;
  t.dtype = DType::F32;
  t.shape = std::move(shape);
  t.copies = std::move(copies);
  return t;
}

Task slab(uint32_t tensor, std::vector<int64_t> start, std::vector<int64_t> extent) {
  Task t;
  t.kind = Task::Kind::Slab;
  t.tensor = tensor;
  t.box = Box{std::move(start), std::move(extent)};
  return t;
}

TEST(SourceFilesRead, ListsTheFilesOfRunsSlabsAndFoldsAndNoOther) {
  // "split": [4, 6], columns 0-2 from file 0, 3-5 from file 1. "folded": W from file 2, A from
  // 3, B from 4. "empty": a [0, 4] tensor over file 6. File 5 is read by a run only.
  MergePlan plan;
  plan.sources.resize(7);
  plan.tensors.push_back(f32_tensor("split", {4, 6},
                                    {f32_slice(0, 0, {3, 1}, {0, 0}, {4, 3}), f32_slice(1, 0, {3, 1}, {0, 3}, {4, 3})}));
  OutputTensor folded = f32_tensor("folded", {2, 2}, {f32_slice(2, 0, {2, 1}, {0, 0}, {2, 2})});
  folded.lora = LoraFold{{f32_slice(3, 0, {2, 1}, {0, 0}, {1, 2})}, {f32_slice(4, 0, {1, 1}, {0, 0}, {2, 1})}, 1, 1.0, false};
  plan.tensors.push_back(folded);
  plan.tensors.push_back(f32_tensor("empty", {0, 4}, {f32_slice(6, 0, {4, 1}, {0, 0}, {0, 4})}));
  plan.tensors.push_back(f32_tensor("whole", {4}, {f32_slice(5, 0, {1}, {0}, {4})}));

  EXPECT_EQ(source_files_read(plan, {slab(0, {0, 0}, {4, 3})}), std::vector<uint32_t>{0});
  EXPECT_EQ(source_files_read(plan, {slab(0, {1, 3}, {1, 3})}), std::vector<uint32_t>{1});
  EXPECT_EQ(source_files_read(plan, {slab(0, {2, 2}, {1, 2})}), (std::vector<uint32_t>{0, 1}));
  Task fold;
  fold.kind = Task::Kind::Fold;
  fold.tensor = 1;
  EXPECT_EQ(source_files_read(plan, {fold}), (std::vector<uint32_t>{2, 3, 4}));
  Task run;
  run.tensor = 3;
  run.src_file = 5;
  EXPECT_EQ(source_files_read(plan, {run, slab(0, {3, 0}, {1, 1})}), (std::vector<uint32_t>{0, 5}));
  EXPECT_EQ(source_files_read(plan, {}), std::vector<uint32_t>{});
  // All of the plan's tasks: every file but the empty tensor's.
  EXPECT_EQ(source_files_read(plan, make_tasks(plan, TaskLimits{16, 16})), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
}

// What an executor writes, per output file.
class MemorySink : public OutputSink {
 public:
  explicit MemorySink(const MergePlan& plan) {
    for (const OutputFile& f : plan.files) files_.emplace_back(f.size, '\0');
  }
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override {
    std::memcpy(files_[file].data() + offset, data, n);
  }
  std::vector<float> floats(const OutputTensor& t) const {
    std::vector<float> v(t.nbytes / 4);
    std::memcpy(v.data(), files_[t.file].data() + t.offset, t.nbytes);
    return v;
  }

 private:
  mutable std::vector<std::string> files_;
};

std::string error_of(const MergePlan& plan, const ExecOptions& opt) {
  try {
    MemorySink sink(plan);
    make_cpu_executor()->run(plan, sink, opt);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "the executor ran";
  return "";
}

// Two source files of 24 floats each, a.bin and b.bin.
class SubsetOfSources : public ::testing::Test {
 protected:
  TempDir dir;
  std::vector<float> a = write_floats("a.bin", 1), b = write_floats("b.bin", 2);
  std::vector<SourceFile> sources = {{dir / "a.bin", 96}, {dir / "b.bin", 96}};

  std::vector<float> write_floats(const std::string& name, uint32_t seed) {
    std::vector<float> v(24);
    std::mt19937 rng(seed);
    for (auto& x : v) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    File f = File::create(dir / name);
    f.write_exact(0, v.data(), 96);
    return v;
  }
  // a.bin as [6, 4] (runs), and its transpose [4, 6] (slabs).
  std::vector<OutputTensor> tensors_of_a() const {
    return {f32_tensor("a", {6, 4}, {f32_slice(0, 0, {4, 1}, {0, 0}, {6, 4})}),
            f32_tensor("a_t", {4, 6}, {f32_slice(0, 0, {1, 4}, {0, 0}, {4, 6})})};
  }
  OutputTensor tensor_of_b() const { return f32_tensor("b", {24}, {f32_slice(1, 0, {1}, {0}, {24})}); }

  // Runs `plan` and checks each tensor of a.bin against a.
  void expect_a_merged(const MergePlan& plan, const ExecOptions& opt = {}) {
    MemorySink sink(plan);
    make_cpu_executor()->run(plan, sink, opt);
    for (const OutputTensor& t : plan.tensors) {
      const std::vector<float> got = sink.floats(t);
      ASSERT_EQ(got.size(), 24u);
      for (size_t i = 0; i < 24; ++i) {
        const size_t at = t.name == "a" ? i : (i % 6) * 4 + i / 6;  // a_t[r][c] = a[c][r]
        ASSERT_EQ(got[i], a[at]) << t.name << " element " << i;
      }
    }
  }
};

TEST_F(SubsetOfSources, AnUnreadSourceThatIsMissingOrADirectoryOrChangedDoesNotMatter) {
  const MergePlan plan = test::one_file_plan(tensors_of_a(), sources);
  fs::remove(dir / "b.bin");
  expect_a_merged(plan);
  fs::create_directory(dir / "b.bin");
  expect_a_merged(plan);
  fs::remove(dir / "b.bin");
  write_small_file(dir / "b.bin", "a different size");  // its stamp would be refused, if it were opened
  expect_a_merged(plan);
}

TEST_F(SubsetOfSources, ATaskOverAMissingSourceFailsNamingIt) {
  std::vector<OutputTensor> tensors = tensors_of_a();
  tensors.push_back(tensor_of_b());
  const MergePlan plan = test::one_file_plan(tensors, sources);
  fs::remove(dir / "b.bin");
  std::string what = error_of(plan, {});
  EXPECT_NE(what.find(dir / "b.bin"), std::string::npos) << what;
  fs::create_directory(dir / "b.bin");
  what = error_of(plan, {});
  EXPECT_NE(what.find(dir / "b.bin"), std::string::npos) << what;
}

TEST_F(SubsetOfSources, ASourceOwnedByAnotherRankIsRefusedNamingTheFileAndBothRanks) {
  sources[0].owner = 1;
  const MergePlan plan = test::one_file_plan(tensors_of_a(), sources);
  ExecOptions rank0;
  rank0.rank = 0;
  const std::string what = error_of(plan, rank0);
  EXPECT_NE(what.find(dir / "a.bin"), std::string::npos) << what;
  EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  ExecOptions rank1;
  rank1.rank = 1;
  expect_a_merged(plan, rank1);
  expect_a_merged(plan);  // a single process (rank -1) reads what it can open
}

TEST_F(SubsetOfSources, AnUnreadSourceOwnedByAnotherRankDoesNotMatter) {
  sources[1].owner = 1;
  ExecOptions rank0;
  rank0.rank = 0;
  expect_a_merged(test::one_file_plan(tensors_of_a(), sources), rank0);
}

TEST_F(SubsetOfSources, EachProcessOfAMultiProcessMergeOpensOnlyTheSourcesOfItsShare) {
  // Output file 0 holds a.bin's tensors, file 1 b.bin's; rank 0 writes file 0, rank 1 file 1.
  MergePlan plan = test::one_file_plan(tensors_of_a(), sources);
  MergePlan second = test::one_file_plan({tensor_of_b()}, sources);
  second.files[0].name = "model-2.safetensors";
  plan.files.push_back(second.files[0]);
  second.tensors[0].file = 1;
  plan.tensors.push_back(second.tensors[0]);
  fs::remove(dir / "b.bin");
  ExecOptions rank0;
  rank0.rank = 0;
  expect_a_merged(dist::share_of(plan, {0, 1}, 0).plan, rank0);
  ExecOptions rank1;
  rank1.rank = 1;
  const std::string what = error_of(dist::share_of(plan, {0, 1}, 1).plan, rank1);
  EXPECT_NE(what.find(dir / "b.bin"), std::string::npos) << what;
}

// assign_files over plans made by hand: output file i reads the sources listed for it.
MergePlan owned_plan(const std::vector<int32_t>& source_owners, const std::vector<std::vector<uint32_t>>& file_sources,
                     const std::vector<uint64_t>& file_sizes) {
  MergePlan plan;
  for (int32_t o : source_owners) {
    std::string path = "/nowhere/src";
    path += std::to_string(plan.sources.size());
    plan.sources.emplace_back(path, 64);
    plan.sources.back().owner = o;
  }
  for (size_t f = 0; f < file_sources.size(); ++f) {
    std::string name = "out";
    name += std::to_string(f);
    name += ".safetensors";
    plan.files.push_back({name, "", file_sizes[f]});
    for (uint32_t src : file_sources[f]) {
      std::string tensor = "t";
      tensor += std::to_string(plan.tensors.size());
      OutputTensor t = f32_tensor(tensor, {4}, {f32_slice(src, 0, {1}, {0}, {4})});
      t.file = static_cast<uint32_t>(f);
      plan.tensors.push_back(t);
    }
  }
  return plan;
}

std::vector<int> all_ranks(int world_size) {
  std::vector<int> r(static_cast<size_t>(world_size));
  std::iota(r.begin(), r.end(), 0);
  return r;
}

// Without a data plane (the TCP bootstrap): every rank may write, no bytes move.
std::vector<int> assign_in_place(const MergePlan& plan, int world_size) {
  return dist::assign_files(plan, world_size, all_ranks(world_size), false);
}

std::string assign_error(const MergePlan& plan, int world_size) {
  try {
    assign_in_place(plan, world_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(AssignFiles, AFileGoesToTheRankThatOwnsItsSourcesAndTheRestBalanceAroundIt) {
  // Sizes 100 (reads rank 1's source), 60 and 50 (shared sources), 10 (rank 0's). 100 is pinned
  // to rank 1 (without owners it would go to rank 0), 60 and 50 go to the less loaded rank 0
  // (0 < 100, then 60 < 100), 10 to its owner.
  const MergePlan plan = owned_plan({1, kAnyOwner, kAnyOwner, 0}, {{0}, {1}, {2, 1}, {3}}, {100, 60, 50, 10});
  EXPECT_EQ(assign_in_place(plan, 2), (std::vector<int>{1, 0, 0, 0}));
  // With a data plane the same: writing 100 costs rank 0 the 16 bytes it would fetch.
  EXPECT_EQ(dist::assign_files(plan, 2, {0, 1}, true), (std::vector<int>{1, 0, 0, 0}));
  // Everything shared: plain balance by bytes, largest first.
  const MergePlan shared = owned_plan({kAnyOwner, kAnyOwner, kAnyOwner, kAnyOwner}, {{0}, {1}, {2}, {3}}, {100, 60, 50, 10});
  EXPECT_EQ(assign_in_place(shared, 2), (std::vector<int>{0, 1, 1, 0}));
}

TEST(AssignFiles, WithADataPlaneAFileNeedingTwoRanksGoesWhereLessMustBeFetched) {
  // File 0 reads 4 floats of rank 0 and 8 of rank 1 (two tensors over source 1): rank 1 fetches
  // less. File 1 reads rank 0's source only, and rank 1 is loaded: rank 0.
  const MergePlan plan = owned_plan({0, 1}, {{0, 1, 1}, {0}}, {10, 10});
  EXPECT_EQ(dist::assign_files(plan, 2, {0, 1}, true), (std::vector<int>{1, 0}));
  // Only rank 0 sees the target: it writes everything, fetching what it lacks.
  EXPECT_EQ(dist::assign_files(plan, 3, {0}, true), (std::vector<int>{0, 0}));
  // Three writers, three files of equal size, each reading one rank's source: each to its owner.
  const MergePlan three = owned_plan({2, 0, 1}, {{0}, {1}, {2}}, {30, 30, 30});
  EXPECT_EQ(dist::assign_files(three, 3, {0, 1, 2}, true), (std::vector<int>{2, 0, 1}));
}

TEST(AssignFiles, AFileNeedingTwoRanksSourcesIsRefusedNamingItAndBothRanks) {
  const MergePlan plan = owned_plan({0, 1}, {{0, 1}}, {10});
  const std::string what = assign_error(plan, 2);
  EXPECT_NE(what.find("out0.safetensors"), std::string::npos) << what;
  EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
  EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("/nowhere/src1"), std::string::npos) << what;
}

TEST(AssignFiles, LoraSlicesCountAndAnOwnerPastTheWorldIsRefused) {
  MergePlan plan = owned_plan({1, 1, 0}, {{0}}, {10});
  plan.tensors[0].lora = LoraFold{{f32_slice(1, 0, {1}, {0}, {4})}, {f32_slice(2, 0, {1}, {0}, {4})}, 1, 1.0, false};
  EXPECT_NE(assign_error(plan, 2).find("/nowhere/src2"), std::string::npos);
  plan.tensors[0].lora->b[0].file = 1;
  EXPECT_EQ(assign_in_place(plan, 2), std::vector<int>{1});
  const std::string what = assign_error(plan, 1);
  EXPECT_NE(what.find("owned by rank 1"), std::string::npos) << what;
  EXPECT_NE(what.find("1 processes"), std::string::npos) << what;
}

}  // namespace
}  // namespace shardmerge
