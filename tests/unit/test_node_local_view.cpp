// NodeLocalView: who reads each file of a role dir spread over nodes, what planning sees, and
// the removal of views that killed runs left in $TMPDIR. Listings are written by hand here;
// the expected owners follow from the rules in node_local.hpp.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utime.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "layouts/node_local.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;
using namespace shardmerge;
using layouts::NodeFile;
using layouts::NodeLocalView;

namespace {

FileStamp stamp(uint64_t size, uint64_t device) { return FileStamp{size, 1000, 1000, 7, device}; }

NodeFile data(const std::string& rel, uint64_t size, uint64_t device) { return {rel, stamp(size, device), std::nullopt}; }
NodeFile small(const std::string& rel, const std::string& content, uint64_t device) {
  return {rel, stamp(content.size(), device), content};
}

// $TMPDIR pointed at a fresh directory for the test's life.
class ScopedTmpdir {
 public:
  ScopedTmpdir() {
    const char* old = std::getenv("TMPDIR");
    if (old) old_ = old;
    ::setenv("TMPDIR", dir_.path().c_str(), 1);
  }
  ~ScopedTmpdir() {
    if (old_) ::setenv("TMPDIR", old_->c_str(), 1);
    else ::unsetenv("TMPDIR");
  }
  const fs::path& path() const { return dir_.path(); }

 private:
  test::TempDir dir_;
  std::optional<std::string> old_;
};

}  // namespace

TEST(NodeLocalView, OwnersArePerFileHoldersAndAnyForAFileEverySeesAlike) {
  ScopedTmpdir tmp;
  const std::string role = "/ckpt/global_step_5/actor";
  // Node 0: rank 0 and 2 files and the sidecars; node 1: ranks 1, 3; node 2: rank 2 again (a
  // copy: the lowest holder reads it) and nothing else; the config is on a filesystem all see.
  const std::vector<std::vector<NodeFile>> listings = {
      {data("model_world_size_4_rank_0.pt", 100, 1), data("model_world_size_4_rank_2.pt", 300, 1),
       small("fsdp_config.json", "{\"world_size\": 4}", 1), small("shared.json", "{}", 9)},
      {data("model_world_size_4_rank_1.pt", 200, 2), data("model_world_size_4_rank_3.pt", 400, 2),
       small("shared.json", "{}", 9)},
      {data("model_world_size_4_rank_2.pt", 300, 3), small("shared.json", "{}", 9)},
  };
  NodeLocalView view(role, listings, 2);
  auto owner = [&](const std::string& rel) { return view.holder_of(role + "/" + rel).value().first; };
  EXPECT_EQ(owner("model_world_size_4_rank_0.pt"), 0);
  EXPECT_EQ(owner("model_world_size_4_rank_1.pt"), 1);
  EXPECT_EQ(owner("model_world_size_4_rank_2.pt"), 0);
  EXPECT_EQ(owner("model_world_size_4_rank_3.pt"), 1);
  EXPECT_EQ(owner("fsdp_config.json"), 0);
  EXPECT_EQ(owner("shared.json"), kAnyOwner);
  EXPECT_FALSE(view.holder_of(role + "/model_world_size_4_rank_9.pt"));
  // Rank 2 holds a copy of rank 2's file but rank 0 summarises it: nothing is summarised on rank 2.
  EXPECT_TRUE(view.summarised_here().empty());
  EXPECT_EQ(NodeLocalView(role, listings, 1).summarised_here(),
            (std::vector<std::string>{role + "/model_world_size_4_rank_1.pt", role + "/model_world_size_4_rank_3.pt"}));

  // What planning sees: placeholders of the data files' sizes, the small files' bytes.
  const fs::path v = view.view_dir();
  EXPECT_EQ(v.filename(), "actor");
  EXPECT_EQ(fs::file_size(v / "model_world_size_4_rank_3.pt"), 400u);
  std::ifstream in(v / "fsdp_config.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "{\"world_size\": 4}");
  EXPECT_EQ(view.real_path((v / "model_world_size_4_rank_3.pt").string()), role + "/model_world_size_4_rank_3.pt");
  EXPECT_EQ(view.real_path("/elsewhere/x"), "/elsewhere/x");
}

TEST(NodeLocalView, TwoSizesOfOneDataFileAreRefusedNamingBothRanks) {
  ScopedTmpdir tmp;
  const std::vector<std::vector<NodeFile>> listings = {{data("model_world_size_2_rank_1.pt", 100, 1)},
                                                       {data("model_world_size_2_rank_1.pt", 99, 2)}};
  try {
    NodeLocalView view("/ckpt/actor", listings, 0);
    FAIL() << "accepted two sizes of one rank file";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 holds 100 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 99"), std::string::npos) << what;
    EXPECT_NE(what.find("/ckpt/actor/model_world_size_2_rank_1.pt"), std::string::npos) << what;
  }
}

TEST(NodeLocalView, IsRemovedWhenItGoesAndRemovesViewsOfKilledRuns) {
  ScopedTmpdir tmp;
  // A view whose pid is this process's but made before it started: a killed run's, whose pid
  // was reused. And one made now by this process: a live run's, kept.
  const fs::path stale = tmp.path() / ("shardmerge-view-" + std::to_string(::getpid()) + "-Ab12Cd");
  const fs::path live = tmp.path() / ("shardmerge-view-" + std::to_string(::getpid()) + "-Zz99Yy");
  const fs::path other = tmp.path() / "shardmerge-view-notapid";
  for (const auto& d : {stale, live, other}) fs::create_directories(d / "actor");
  const struct utimbuf long_ago {1000000000, 1000000000};  // 2001
  ASSERT_EQ(::utime(stale.c_str(), &long_ago), 0);
  ASSERT_EQ(::utime(other.c_str(), &long_ago), 0);
  fs::path made;
  {
    NodeLocalView view("/ckpt/actor", {{data("model_world_size_1_rank_0.pt", 10, 1)}}, 0);
    made = fs::path(view.view_dir()).parent_path();
    EXPECT_TRUE(fs::exists(made));
    EXPECT_EQ(made.parent_path(), tmp.path());
  }
  EXPECT_FALSE(fs::exists(made));
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));  // not a name a view has
}
