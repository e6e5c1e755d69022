// `verify`'s independent route: a planning error (a Slice placed at the wrong box) that the old
// same-plan comparison passes is reported, and the assembly reports gaps and overlaps.
#include <gtest/gtest.h>

#include <filesystem>

#include "formats/hf_index.hpp"
#include "formats/safetensors.hpp"
#include "layouts/layout.hpp"
#include "pipeline/planner.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "test_support.hpp"
#include "util/file.hpp"
#include "util/shape.hpp"
#include "verify/compare.hpp"
#include "verify/reference_assembly.hpp"
#include "verify/reference_verify.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge {
namespace {

using test::TempDir;

PlannedMerge plan_fixture(const std::string& role) {
  MergeRequest request;
  request.local_dir = (std::filesystem::path(test::fixtures_dir()) / role).string();
  return plan_merge(request);
}

void write_tree(const MergePlan& plan, const std::string& out) {
  HfTreeWriter writer(out, false, "");
  writer.create(plan);
  make_cpu_executor()->run(plan, writer, ExecOptions{});
  writer.commit(plan);
}

// The old `verify`: the same plan through the same executor, compared with the tree.
bool same_plan_comparison_passes(const MergePlan& plan, const std::string& out) {
  const HfWeights written = open_hf_weights(out);
  CompareSink sink(plan, written, 0);
  make_cpu_executor()->run(plan, sink, ExecOptions{});
  return sink.result().equal();
}

// Swaps where two equal-sized slices go: the rank order of a concatenation gets wrong, every
// slice still lands inside the tensor and the slices still tile it.
void swap_two_slice_starts(std::vector<Slice>& slices) {
  for (size_t i = 0; i < slices.size(); ++i)
    for (size_t j = i + 1; j < slices.size(); ++j)
      if (slices[i].extent == slices[j].extent && slices[i].start != slices[j].start) {
        std::swap(slices[i].start, slices[j].start);
        return;
      }
  FAIL() << "no two slices of the same extent";
}

void expect_only_mismatch(const ReferenceCheck& check, const std::string& victim) {
  EXPECT_FALSE(check.diff.equal());
  EXPECT_TRUE(check.diff.missing.empty() && check.diff.unexpected.empty() && check.diff.mismatched_meta.empty());
  ASSERT_TRUE(check.diff.values.count(victim));
  EXPECT_GT(check.diff.values.at(victim).mismatched, 0u);
  for (const auto& [name, d] : check.diff.values) {
    if (name == victim) continue;
    EXPECT_EQ(d.mismatched, 0u) << name;
  }
}

TEST(ReferenceVerify, CatchesASliceAtTheWrongBoxThatTheSamePlanPasses) {
  SHARDMERGE_REQUIRE_FIXTURES();
  PlannedMerge pm = plan_fixture("qwen2_fsdp2_w4/global_step_3/actor");
  const std::string victim = "model.embed_tokens.weight";  // rows 63, 63, 63, 62 over four ranks
  TempDir dir;
  {
    const std::string good = dir / "good";
    write_tree(pm.plan, good);
    EXPECT_TRUE(verify_against_sources(pm, good).diff.equal());
  }
  for (OutputTensor& t : pm.plan.tensors)
    if (t.name == victim) swap_two_slice_starts(t.copies);
  const std::string bad = dir / "bad";
  write_tree(pm.plan, bad);
  EXPECT_TRUE(same_plan_comparison_passes(pm.plan, bad));
  expect_only_mismatch(verify_against_sources(pm, bad), victim);
}

TEST(ReferenceVerify, CatchesAWrongLoraSliceInAFold) {
  SHARDMERGE_REQUIRE_FIXTURES();
  PlannedMerge pm = plan_fixture("qwen2_lora_fsdp2_w2/global_step_3/actor");
  std::string victim;
  for (OutputTensor& t : pm.plan.tensors)
    if (t.lora && victim.empty() && t.lora->b.size() > 1) {
      victim = t.name;
      swap_two_slice_starts(t.lora->b);  // B's row blocks of the two ranks swapped
    }
  ASSERT_FALSE(victim.empty());
  TempDir dir;
  const std::string bad = dir / "bad";
  write_tree(pm.plan, bad);
  EXPECT_TRUE(same_plan_comparison_passes(pm.plan, bad));
  const ReferenceCheck check = verify_against_sources(pm, bad);
  expect_only_mismatch(check, victim);
  EXPECT_GT(check.folds, 0u);
}

TEST(ReferenceVerify, CatchesAWrongQkvSplitOfAMegatronTensor) {
  SHARDMERGE_REQUIRE_FIXTURES();
  MergeRequest request;
  request.local_dir = (std::filesystem::path(test::fixtures_dir()) / "qwen2_megatron_tp2/global_step_1/actor").string();
  PlannedMerge pm = plan_merge(request);
  const std::string victim = "model.layers.1.self_attn.k_proj.weight";  // one head_dim block per KV group
  for (OutputTensor& t : pm.plan.tensors)
    if (t.name == victim) swap_two_slice_starts(t.copies);
  TempDir dir;
  const std::string bad = dir / "bad";
  write_tree(pm.plan, bad);
  EXPECT_TRUE(same_plan_comparison_passes(pm.plan, bad));
  expect_only_mismatch(verify_against_sources(pm, bad), victim);
}

// The assembly alone, against torch's own full_tensor() / ShardedTensor.gather() of every
// saved value (expected.safetensors, written by the fixture generator): _StridedShard with
// Shard on a 2-D mesh and a 1-D sub-mesh, HSDP replicas, Shard(1), ShardedTensor offsets and
// empty last shards.
TEST(ReferenceAssemblyOnFixtures, EqualsTheGathersOfTorch) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const std::filesystem::path fx = test::fixtures_dir();
  for (const std::string name : {"qwen2_fsdp2_tp_2x2", "qwen2_hsdp_2x2", "llama_fsdp2_shard1_w4",
                                 "qwen2_fsdp1_sharded_tensor_w2", "qwen2_critic_fsdp2_w2", "qwen2_fsdp2_w4"}) {
    SCOPED_TRACE(name);
    const std::string role =
        (fx / name / "global_step_3" / (name.find("critic") != std::string::npos ? "critic" : "actor"));
    const layouts::Layout layout = layouts::detect(role);
    const ReferenceSources sources = reference_from_fsdp(std::get<layouts::FsdpRole>(layout.info));
    const SafetensorsFile expected = SafetensorsFile::open((fx / name / "expected.safetensors").string());
    const File expected_file = File::open_read(expected.path());
    ASSERT_EQ(sources.tensors.size(), expected.tensors().size());
    for (const ReferenceTensor& t : sources.tensors) {
      const SafetensorsTensor* e = expected.find(t.name);
      ASSERT_TRUE(e) << t.name;
      ASSERT_EQ(e->shape, t.shape) << t.name;
      std::vector<uint8_t> want(e->nbytes), got(e->nbytes);
      expected_file.read_exact(e->file_offset, want.data(), want.size());
      ElementFetcher fetch(sources, t);
      const size_t es = dtype_size(t.dtype);
      const int64_t row = t.shape.empty() ? 1 : t.shape.back();
      std::vector<int64_t> index(t.shape.size(), 0);
      for (uint64_t pos = 0; pos < element_count(t.shape); pos += static_cast<uint64_t>(row)) {
        for (size_t d = t.shape.size(), rest = pos; d-- > 0; rest /= static_cast<size_t>(t.shape[d]))
          index[d] = static_cast<int64_t>(rest % static_cast<size_t>(t.shape[d]));
        ASSERT_EQ(fetch.fetch_run(index.data(), row, got.data() + pos * es), 0u) << t.name << " at element " << pos;
      }
      EXPECT_EQ(got, want) << t.name;
    }
  }
}

// A 4 x 2 float tensor in one file; pieces of it as rows.
class ReferenceAssembly : public ::testing::Test {
 protected:
  TempDir dir;
  ReferenceSources sources;
  void SetUp() override {
    const std::vector<float> values = {0, 1, 2, 3, 4, 5, 6, 7};
    File f = File::create(dir / "data.bin");
    f.write_exact(0, values.data(), values.size() * 4);
    sources.files.push_back(dir / "data.bin");
  }
  // Local rows [first, first + n) of the file, placed at the global rows `rows`.
  ReferencePiece rows(int64_t first, std::vector<int64_t> global_rows) {
    return {
        0,           static_cast<uint64_t>(first) * 8, 0, {2, 1}, {std::move(global_rows), index_range(0, 2)}, "test",
        std::nullopt};
  }
};

TEST_F(ReferenceAssembly, FetchesByGlobalIndexAndCountsHolders) {
  // Rows 0 and 2 from file rows 0-1, rows 1 and 3 from file rows 2-3 (an interleaved split).
  sources.tensors.push_back({"t", DType::F32, {4, 2}, {rows(0, {0, 2}), rows(2, {1, 3})}});
  ElementFetcher fetch(sources, sources.tensors[0]);
  float v = -1;
  const int64_t row1_col1[] = {1, 1}, row2_col0[] = {2, 0};
  EXPECT_EQ(fetch.fetch(row1_col1, reinterpret_cast<uint8_t*>(&v)), 1);
  EXPECT_EQ(v, 5.0f);  // file row 2, column 1
  EXPECT_EQ(fetch.fetch(row2_col0, reinterpret_cast<uint8_t*>(&v)), 1);
  EXPECT_EQ(v, 2.0f);  // file row 1, column 0
}

TEST_F(ReferenceAssembly, ReportsGapsAndOverlaps) {
  sources.tensors.push_back({"t", DType::F32, {4, 2}, {rows(0, {0, 1}), rows(1, {1, 2})}});
  ElementFetcher fetch(sources, sources.tensors[0]);
  float v;
  const int64_t row1[] = {1, 0}, row3[] = {3, 0};
  EXPECT_EQ(fetch.fetch(row1, reinterpret_cast<uint8_t*>(&v)), 2);  // held twice
  EXPECT_EQ(fetch.fetch(row3, reinterpret_cast<uint8_t*>(&v)), 0);  // held by nobody
}

TEST_F(ReferenceAssembly, RefusesAPieceOutsideTheTensor) {
  sources.tensors.push_back({"t", DType::F32, {4, 2}, {rows(0, {0, 4})}});
  EXPECT_THROW(ElementFetcher(sources, sources.tensors[0]), Error);
}

}  // namespace
}  // namespace shardmerge
