// What a path is: run roots, trackers, step roots, FSDP/Megatron role dirs, HF trees, adapters.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "layouts/layout.hpp"
#include "layouts/names.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;

namespace shardmerge::layouts {
namespace {

using test::TempDir;

void touch(const fs::path& p, const std::string& content = "x") {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << content;
}

TEST(LayoutNames, RankFilesAndMpRankDirs) {
  auto r = parse_rank_file_name("model_world_size_64_rank_7.pt", "model");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->world_size, 64);
  EXPECT_EQ(r->rank, 7);
  EXPECT_FALSE(parse_rank_file_name("model_world_size_64_rank_7.pt", "optim"));
  EXPECT_FALSE(parse_rank_file_name("model_world_size__rank_7.pt", "model"));
  EXPECT_FALSE(parse_rank_file_name("model_world_size_8_rank_x.pt", "model"));
  EXPECT_EQ(rank_file_name("extra_state", 4, 2), "extra_state_world_size_4_rank_2.pt");
  auto m = parse_mp_rank_dir("mp_rank_01_002_003");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->tp, 1);
  EXPECT_EQ(m->pp, 2);
  EXPECT_EQ(m->ep, 3);
  EXPECT_FALSE(parse_mp_rank_dir("mp_rank_"));
  EXPECT_FALSE(parse_mp_rank_dir("mp_rank_01_02_03_04"));
}

TEST(LayoutDetect, MissingPathIsAUsageError) {
  try {
    detect("/nonexistent/shardmerge/path");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
  }
}

TEST(LayoutDetect, FsdpRoleDirRanksAndConfig) {
  TempDir d;
  const fs::path role = d.path() / "actor";
  for (int r : {0, 1, 3}) touch(role / rank_file_name("model", 4, r));
  touch(role / rank_file_name("optim", 4, 0));
  touch(role / "fsdp_config.json", R"({"FSDP_version": 2, "world_size": 4})");
  touch(role / "huggingface" / "config.json", R"({"architectures": ["Qwen2ForCausalLM"]})");
  touch(role / "huggingface" / "tokenizer.json", "{}");
  touch(role / "lora_train_meta.json", R"({"r": 8, "lora_alpha": 16})");
  Layout l = detect(role.string());
  ASSERT_EQ(l.kind, Kind::FsdpRole);
  const auto& f = std::get<FsdpRole>(l.info);
  EXPECT_EQ(f.world_size, 4);
  EXPECT_EQ(f.world_size_source, "fsdp_config.json");
  EXPECT_EQ(f.fsdp_version, 2);
  EXPECT_EQ(f.missing_ranks, (std::vector<int64_t>{2}));
  EXPECT_EQ(f.optim_files, 1);
  ASSERT_TRUE(f.huggingface);
  EXPECT_EQ(f.huggingface->architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(f.huggingface->weights, HfTree::Weights::None);
  ASSERT_TRUE(f.lora_train_meta);
  EXPECT_EQ((*f.lora_train_meta)["r"], 8);
}

// verl's NeMo-Automodel engine: model/shard-*.safetensors, model/consolidated/, optim/; a step
// root finds it as a role, and a save without the consolidated model is still recognised.
TEST(LayoutDetect, AutomodelRoleDir) {
  TempDir d;
  const fs::path role = d.path() / "global_step_3" / "actor";
  for (const char* shard : {"shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"})
    touch(role / "model" / shard);
  touch(role / "model" / "consolidated" / "config.json", R"({"architectures": ["LlamaForCausalLM"]})");
  touch(role / "model" / "consolidated" / "model.safetensors");
  touch(role / "optim" / ".metadata");
  Layout l = detect(role.string());
  ASSERT_EQ(l.kind, Kind::AutomodelRole);
  const auto& a = std::get<AutomodelRole>(l.info);
  EXPECT_EQ(a.shard_files, 2);
  EXPECT_TRUE(a.has_optimizer);
  ASSERT_TRUE(a.consolidated);
  EXPECT_TRUE(a.consolidated->weights_complete);
  EXPECT_EQ(a.consolidated->architecture, "LlamaForCausalLM");
  EXPECT_EQ(std::get<StepRoot>(detect((d.path() / "global_step_3").string()).info).roles, (std::vector<std::string>{"actor"}));
  fs::remove_all(role / "model" / "consolidated");
  l = detect(role.string());
  ASSERT_EQ(l.kind, Kind::AutomodelRole);
  EXPECT_FALSE(std::get<AutomodelRole>(l.info).consolidated);
}

TEST(LayoutDetect, OldCheckpointsTakeTheWorldSizeFromFileNames) {
  TempDir d;
  for (int r = 0; r < 2; ++r) touch(d.path() / rank_file_name("model", 2, r));
  Layout l = detect(d.path().string());
  const auto& f = std::get<FsdpRole>(l.info);
  EXPECT_EQ(f.world_size, 2);
  EXPECT_EQ(f.world_size_source, "rank file names");
  ASSERT_FALSE(l.warnings.empty());
  EXPECT_NE(l.warnings[0].find("rank file names"), std::string::npos);
}

TEST(LayoutDetect, RunRootTrackerAndResolution) {
  TempDir d;
  for (int s : {1, 3}) touch(d.path() / ("global_step_" + std::to_string(s)) / "actor" / rank_file_name("model", 1, 0));
  touch(d.path() / "latest_checkpointed_iteration.txt", "3\n");
  Layout l = detect(d.path().string());
  ASSERT_EQ(l.kind, Kind::RunRoot);
  const auto& run = std::get<RunRoot>(l.info);
  EXPECT_EQ(run.steps.size(), 2u);
  EXPECT_EQ(run.tracker_step, 3);
  EXPECT_TRUE(run.tracker_problem.empty());
  std::vector<std::string> notes;
  EXPECT_EQ(resolve_role_dir(d.path().string(), "actor", notes), (d.path() / "global_step_3" / "actor").string());
  EXPECT_EQ(notes.size(), 2u);

  // A tracker that points to a missing step is reported; the highest step is used instead.
  touch(d.path() / "latest_checkpointed_iteration.txt", "7");
  Layout stale = detect(d.path().string());
  EXPECT_NE(std::get<RunRoot>(stale.info).tracker_problem.find("step 7"), std::string::npos);
  notes.clear();
  EXPECT_EQ(resolve_role_dir(d.path().string(), "actor", notes), (d.path() / "global_step_3" / "actor").string());
  EXPECT_NE(notes[0].find("highest step"), std::string::npos);

  touch(d.path() / "latest_checkpointed_iteration.txt", "three");
  EXPECT_NE(std::get<RunRoot>(detect(d.path().string()).info).tracker_problem.find("step number"), std::string::npos);
}

TEST(LayoutDetect, StepRootRolesAndMissingRole) {
  TempDir d;
  const fs::path step = d.path() / "global_step_5";
  touch(step / "actor" / rank_file_name("model", 1, 0));
  touch(step / "critic" / rank_file_name("model", 1, 0));
  touch(step / "data.pt");
  Layout l = detect(step.string());
  ASSERT_EQ(l.kind, Kind::StepRoot);
  const auto& s = std::get<StepRoot>(l.info);
  EXPECT_EQ(s.step, 5);
  EXPECT_EQ(s.roles, (std::vector<std::string>{"actor", "critic"}));
  EXPECT_TRUE(s.has_dataloader_state);
  std::vector<std::string> notes;
  EXPECT_EQ(resolve_role_dir(step.string(), "critic", notes), (step / "critic").string());
  EXPECT_THROW(resolve_role_dir(step.string(), "ref", notes), Error);
}

TEST(LayoutDetect, MegatronLayouts) {
  TempDir d;
  touch(d.path() / "v2" / "ckpt_contents.json",
        R"({"schema_version": 2, "contents": {"model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"}}})");
  touch(d.path() / "v2" / "model" / "dist_ckpt" / ".metadata");
  touch(d.path() / "v1" / "dist_ckpt" / ".metadata");
  touch(d.path() / "v1" / "transformer_config.json", "{}");
  touch(d.path() / "legacy" / "model" / "mp_rank_00_000" / "model.pt");
  Layout v2 = detect((d.path() / "v2").string());
  ASSERT_EQ(v2.kind, Kind::MegatronRole);
  EXPECT_EQ(std::get<MegatronRole>(v2.info).layout, "v2 manifest");
  EXPECT_EQ(std::get<MegatronRole>(v2.info).model_format, "megatron_dist_checkpoint");
  EXPECT_EQ(std::get<MegatronRole>(detect((d.path() / "v1").string()).info).layout, "v1 dist_ckpt");
  const auto legacy = detect((d.path() / "legacy").string());
  EXPECT_EQ(std::get<MegatronRole>(legacy.info).mp_rank_dirs.size(), 1u);
}

TEST(LayoutDetect, HfTreesAdaptersAndUnknown) {
  TempDir d;
  const fs::path hf = d.path() / "hf";
  touch(hf / "config.json", "{}");
  touch(hf / "model.safetensors.index.json", R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  touch(hf / "model-00001-of-00002.safetensors");
  Layout l = detect(hf.string());
  ASSERT_EQ(l.kind, Kind::HfTree);
  const auto& t = std::get<HfTree>(l.info);
  EXPECT_FALSE(t.weights_complete);
  EXPECT_EQ(t.missing_shards, (std::vector<std::string>{"model-00002-of-00002.safetensors"}));
  EXPECT_EQ(t.sidecar_files, (std::vector<std::string>{"config.json"}));
  touch(d.path() / "adapter" / "adapter_config.json", R"({"r": 8})");
  EXPECT_EQ(detect((d.path() / "adapter").string()).kind, Kind::PeftAdapter);
  fs::create_directories(d.path() / "empty");
  EXPECT_EQ(detect((d.path() / "empty").string()).kind, Kind::Unknown);
}

}  // namespace
}  // namespace shardmerge::layouts
