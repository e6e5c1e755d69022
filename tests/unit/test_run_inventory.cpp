// The run inventory and prune's keep rule, from hand-built listings (no files).
#include <gtest/gtest.h>

#include "layouts/names.hpp"
#include "layouts/run_inventory.hpp"
#include "shardmerge/error.hpp"

using namespace shardmerge;
using namespace shardmerge::layouts;

namespace {

// A complete FSDP actor of world size 2, as detect() and the walk would describe it.
RoleListing fsdp_actor(int64_t world_size = 2) {
  FsdpRole f;
  f.world_size = world_size;
  RoleListing r{"actor", f, {"fsdp_config.json", "huggingface/config.json"}, {}};
  for (int64_t rank = 0; rank < world_size; ++rank) {
    std::get<FsdpRole>(r.info).rank_files.push_back(rank_file_name("model", world_size, rank));
    for (const char* p : {"model", "optim", "extra_state"}) r.files.push_back(rank_file_name(p, world_size, rank));
  }
  return r;
}

StepListing step(int64_t n, std::vector<RoleListing> roles = {fsdp_actor()}) {
  StepListing s;
  s.step = n;
  s.name = "global_step_" + std::to_string(n);
  s.roles = std::move(roles);
  s.bytes = 1000 + static_cast<uint64_t>(n);
  return s;
}

RunListing run(std::vector<StepListing> steps, std::optional<std::string> tracker) {
  RunListing l;
  l.path = "/runs/r";
  l.steps = std::move(steps);
  l.tracker_text = std::move(tracker);
  return l;
}

// The names plan_prune removes.
std::vector<std::string> removed(const RunInventory& inv, int64_t keep) {
  std::vector<std::string> out;
  for (const auto& d : plan_prune(inv, keep))
    if (d.remove) out.push_back(d.step->name);
  return out;
}

using Names = std::vector<std::string>;

}  // namespace

TEST(RunInventory, CompleteStepsAndTracker) {
  const auto inv = build_inventory(run({step(20), step(10)}, "20\n"));
  ASSERT_EQ(inv.steps.size(), 2u);
  EXPECT_EQ(inv.steps[0].step, 10);  // sorted
  EXPECT_TRUE(inv.steps[0].complete());
  EXPECT_TRUE(inv.steps[1].tracked);
  EXPECT_FALSE(inv.steps[0].tracked);
  EXPECT_EQ(inv.tracker_step, 20);
  EXPECT_TRUE(inv.tracker_problem.empty());
}

TEST(RunInventory, MissingRankFilesAndSidecars) {
  auto missing_model = fsdp_actor();
  std::get<FsdpRole>(missing_model.info).missing_ranks = {1};
  auto missing_optim = fsdp_actor();
  std::erase(missing_optim.files, rank_file_name("optim", 2, 1));
  auto no_config = fsdp_actor();
  std::erase(no_config.files, std::string("fsdp_config.json"));
  auto no_hf = fsdp_actor();
  std::erase(no_hf.files, std::string("huggingface/config.json"));
  auto no_optim_at_all = fsdp_actor();  // save_contents without optimizer: still complete
  std::erase_if(no_optim_at_all.files, [](const std::string& f) { return f.rfind("optim_", 0) == 0; });
  const auto inv = build_inventory(
      run({step(1, {missing_model}), step(2, {missing_optim}), step(3, {no_config}), step(4, {no_hf}),
           step(5, {no_optim_at_all})},
          "5"));
  EXPECT_EQ(inv.steps[0].problems, Names{"actor: missing model rank files for ranks 1"});
  EXPECT_EQ(inv.steps[1].problems, Names{"actor: missing optim rank files for ranks 1"});
  EXPECT_EQ(inv.steps[2].problems, Names{"actor: no fsdp_config.json"});
  EXPECT_EQ(inv.steps[3].problems, Names{"actor: no huggingface/config.json"});
  EXPECT_TRUE(inv.steps[4].complete());
}

TEST(RunInventory, TempEntriesSymlinksAndEmptySteps) {
  auto with_temp = step(1);
  with_temp.temp_entries = {"actor/huggingface.tmp-123-0"};
  auto link = step(2, {});
  link.symlink_target = "/elsewhere/global_step_2";
  const auto inv = build_inventory(run({with_temp, link, step(3, {})}, "3"));
  EXPECT_EQ(inv.steps[0].problems, Names{"temporary entry left by a killed writer: actor/huggingface.tmp-123-0"});
  EXPECT_FALSE(inv.steps[1].complete());
  EXPECT_FALSE(inv.steps[2].complete());
}

TEST(RunInventory, MegatronDcpFilesNamedByMetadata) {
  MegatronRole m;
  m.layout = "v1 dist_ckpt";
  RoleListing role{"actor", m, {"dist_ckpt/.metadata", "dist_ckpt/__0_0.distcp", "huggingface/config.json"}, {}};
  role.dcp.push_back({"dist_ckpt", {"__0_0.distcp", "__1_0.distcp"}, ""});
  auto inv = build_inventory(run({step(1, {role})}, "1"));
  EXPECT_EQ(inv.steps[0].problems, Names{"actor: dist_ckpt: files named by .metadata missing: __1_0.distcp"});
  role.files.push_back("dist_ckpt/__1_0.distcp");
  inv = build_inventory(run({step(1, {role})}, "1"));
  EXPECT_TRUE(inv.steps[0].complete());
  role.dcp.clear();  // no .metadata
  inv = build_inventory(run({step(1, {role})}, "1"));
  EXPECT_FALSE(inv.steps[0].complete());
}

TEST(RunInventory, MegatronLegacyGrid) {
  MegatronRole m;
  m.layout = "legacy mp_rank";
  m.mp_rank_dirs = {"/x/model/mp_rank_00_000", "/x/model/mp_rank_00_001", "/x/model/mp_rank_01_000"};
  RoleListing role{"actor", m,
                   {"hf_config_and_tokenizer/config.json", "model/mp_rank_00_000/model.pt",
                    "model/mp_rank_00_001/model.pt", "model/mp_rank_01_000/model.pt"},
                   {}};
  const auto inv = build_inventory(run({step(1, {role})}, "1"));
  EXPECT_EQ(inv.steps[0].problems, Names{"actor: model/mp_rank_01_001/model.pt missing"});
}

TEST(RunInventory, TrackerProblems) {
  EXPECT_EQ(build_inventory(run({step(1)}, std::nullopt)).tracker_problem, "no latest_checkpointed_iteration.txt");
  EXPECT_NE(build_inventory(run({step(1)}, "x1")).tracker_problem.find("does not hold a step number"), std::string::npos);
  const auto inv = build_inventory(run({step(1)}, "7"));
  EXPECT_EQ(inv.tracker_step, 7);
  EXPECT_NE(inv.tracker_problem.find("names step 7, which has no global_step_7"), std::string::npos);
}

TEST(PrunePlan, KeepsNewestCompleteSteps) {
  const auto inv = build_inventory(run({step(10), step(20), step(30), step(40)}, "40"));
  EXPECT_EQ(removed(inv, 1), (Names{"global_step_10", "global_step_20", "global_step_30"}));
  EXPECT_EQ(removed(inv, 2), (Names{"global_step_10", "global_step_20"}));
  EXPECT_EQ(removed(inv, 4), Names{});
  EXPECT_EQ(removed(inv, 9), Names{});
}

TEST(PrunePlan, NeverRemovesTrackerOrNewer) {
  // The tracker names 20: 30 and 40 may be saves in progress (or async saves without a tracker).
  const auto inv = build_inventory(run({step(10), step(20), step(30), step(40)}, "20"));
  EXPECT_EQ(removed(inv, 1), Names{"global_step_10"});
  const auto decisions = plan_prune(inv, 1);
  EXPECT_NE(decisions[2].reason.find("newer than the tracker"), std::string::npos);
}

TEST(PrunePlan, IncompleteStepsDoNotCount) {
  auto broken = fsdp_actor();
  std::get<FsdpRole>(broken.info).missing_ranks = {0};
  // 25 is incomplete and newer than the oldest kept complete step (20): kept. 15 is older: removed.
  const auto inv = build_inventory(
      run({step(10), step(15, {broken}), step(20), step(25, {broken}), step(30)}, "30"));
  EXPECT_EQ(removed(inv, 2), (Names{"global_step_10", "global_step_15"}));
  // An incomplete tracker step is kept and keeps `keep` complete steps below it.
  const auto inv2 = build_inventory(run({step(10), step(20), step(30, {broken})}, "30"));
  EXPECT_EQ(removed(inv2, 1), Names{"global_step_10"});
  // Fewer complete steps than asked for: nothing removed.
  const auto inv3 = build_inventory(run({step(10, {broken}), step(20, {broken}), step(30)}, "30"));
  EXPECT_EQ(removed(inv3, 2), Names{});
}

TEST(PrunePlan, SymlinkedStepsAreNeverRemovedNorCounted) {
  auto link = step(10, {});
  link.symlink_target = "/elsewhere";
  const auto inv = build_inventory(run({link, step(20), step(30)}, "30"));
  EXPECT_EQ(removed(inv, 1), Names{"global_step_20"});
}

TEST(PrunePlan, RefusesWithoutUsableTracker) {
  for (std::optional<std::string> t : {std::optional<std::string>{}, std::optional<std::string>{"abc"},
                                       std::optional<std::string>{"50"}}) {
    const auto inv = build_inventory(run({step(10), step(20)}, t));
    try {
      plan_prune(inv, 1);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), ExitCode::failure);
      EXPECT_NE(std::string(e.what()).find("refusing to prune"), std::string::npos);
    }
  }
  try {
    plan_prune(build_inventory(run({step(10)}, "10")), 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), ExitCode::usage);
  }
}

TEST(StepDirNames, ParsesVerlSpellings) {
  EXPECT_EQ(parse_step_dir("global_step_12"), 12);
  EXPECT_EQ(parse_step_dir("global_steps_3"), 3);
  EXPECT_FALSE(parse_step_dir("global_step_"));
  EXPECT_FALSE(parse_step_dir("global_step_3.tmp-1-0"));
  EXPECT_FALSE(parse_step_dir("global_step_-1"));
  EXPECT_FALSE(parse_step_dir("step_3"));
}
