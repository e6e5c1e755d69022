// The pieces that keep a merge's target safe, without a merge: the target lock, the free-space
// check (with made-up statvfs figures), whether a pid may own a temp dir, and which temp dirs
// beside a target count as left by a killed run.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>

#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/dir_lock.hpp"
#include "util/free_space.hpp"
#include "util/process_start.hpp"
#include "write/stale_temps.hpp"

namespace fs = std::filesystem;

namespace shardmerge {
namespace {

using test::TempDir;

// A pid that existed and has ended (the child is reaped).
int ended_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

TEST(TargetLock, SecondLockerIsRefusedAndReleaseRemovesTheFile) {
  TempDir dir;
  const std::string path = dir / ".out.shardmerge.lock";
  DirLock first = DirLock::try_lock(path);
  ASSERT_TRUE(first.locked());
  // flock locks belong to the open file description: a second open in this process conflicts
  // just as another process's would.
  EXPECT_FALSE(DirLock::try_lock(path).locked());
  first.release();
  EXPECT_FALSE(fs::exists(path));
  DirLock again = DirLock::try_lock(path);
  EXPECT_TRUE(again.locked());
}

TEST(TargetLock, AFileLeftByAKilledHolderIsTakenOver) {
  TempDir dir;
  const std::string path = dir / ".out.shardmerge.lock";
  std::ofstream(path) << "";
  EXPECT_TRUE(DirLock::try_lock(path).locked());
}

TEST(FreeSpace, RefusesAnOutputLargerThanTheFreeSpace) {
  EXPECT_NO_THROW(require_free_space(1000, 1000, "/x"));
  EXPECT_NO_THROW(require_free_space(1000, std::nullopt, "/x"));  // the filesystem does not say
  try {
    require_free_space(3'000'000'000ull, 1'000'000, "/mnt/small");
    FAIL() << "3 GB into 1 MB";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.exit_code(), ExitCode::failure);
    EXPECT_NE(what.find("/mnt/small"), std::string::npos) << what;
    EXPECT_NE(what.find("not enough free space"), std::string::npos) << what;
    EXPECT_NE(what.find("3.00 GB"), std::string::npos) << what;
  }
  EXPECT_TRUE(free_bytes("/").has_value());
}

TEST(StaleTemps, APidOwnsOnlyWhatItCouldHaveMade) {
  const std::time_t now = std::time(nullptr);
  EXPECT_TRUE(process_may_have_made(::getpid(), now));
  // This process started after 1970: a temp dir from then is not its, its pid was reused.
  EXPECT_FALSE(process_may_have_made(::getpid(), 0));
  EXPECT_FALSE(process_may_have_made(ended_pid(), now));
  EXPECT_FALSE(process_may_have_made(0, now));
  // A child that has ended but is not reaped yet (a zombie) still has its pid: it writes nothing.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  for (int i = 0; i < 1000; ++i) {  // until it is a zombie
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string line;
    std::getline(stat, line);
    if (line.find(") Z ") != std::string::npos) break;
    ::usleep(1000);
  }
  EXPECT_FALSE(process_may_have_made(child, now));
  ::waitpid(child, nullptr, 0);
}

TEST(StaleTemps, RemovesOnlyTempDirsOfEndedRunsOfThisTarget) {
  TempDir dir;
  const fs::path target = dir.path() / "out";
  const int dead = ended_pid();
  auto make = [&](const std::string& name) {
    fs::create_directories(dir.path() / name);
    std::ofstream(dir.path() / name / "model.safetensors") << "partial";
    return dir.path() / name;
  };
  const fs::path stale = make("out.tmp-" + std::to_string(dead) + "-0");
  const fs::path live = make("out.tmp-" + std::to_string(::getpid()) + "-3");
  const fs::path other_target = make("outer.tmp-" + std::to_string(dead) + "-0");
  const fs::path not_ours = make("out.tmp-backup");
  const std::vector<std::string> notes = clean_stale_temps(target);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find(stale.string()), std::string::npos) << notes[0];
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other_target));
  EXPECT_TRUE(fs::exists(not_ours));

  // A target moved aside by an unfinished --force swap is put back when the target is missing,
  // and removed when the target exists.
  const fs::path moved = make("out.tmp-" + std::to_string(dead) + "-1.old");
  ASSERT_EQ(clean_stale_temps(target).size(), 1u);
  EXPECT_TRUE(fs::exists(target / "model.safetensors"));
  EXPECT_FALSE(fs::exists(moved));
  make("out.tmp-" + std::to_string(dead) + "-2.old");
  ASSERT_EQ(clean_stale_temps(target).size(), 1u);
  EXPECT_FALSE(fs::exists(dir.path() / ("out.tmp-" + std::to_string(dead) + "-2.old")));
  EXPECT_TRUE(fs::exists(target / "model.safetensors"));
}

}  // namespace
}  // namespace shardmerge
