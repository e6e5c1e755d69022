// Shared helpers for the unit tests: where the generated fixtures are, temp directories, and
// running the shardmerge binary.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "geometry/source_set.hpp"
#include "plan/build.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge::test {

// The directory tests/fixtures/generate.py wrote (ctest sets SHARDMERGE_FIXTURES), or "" when
// there is none.
inline std::string fixtures_dir() {
  const char* dir = std::getenv("SHARDMERGE_FIXTURES");
  if (!dir || !std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) return "";
  return dir;
}


// Skips the current test, visibly, when the real-checkpoint fixtures are absent.
#define SHARDMERGE_REQUIRE_FIXTURES()                                                                  \
  do {                                                                                                 \
    if (::shardmerge::test::fixtures_dir().empty())                                                    \
      GTEST_SKIP() << "real-checkpoint fixtures are not generated (configure with "                   \
                      "-DSHARDMERGE_PYTHON=<python with torch>, see tests/fixtures/README.md)";        \
  } while (0)

// A fresh directory under the system temp dir, removed when the object goes.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};
// Runs the shardmerge binary with `args` (shell-quoted by the caller).
CommandResult run_shardmerge(const std::string& args);

std::string read_file(const std::string& path);

// A whole, row-major tensor stored densely at `offset` of source file 0.
SourceTensor whole_tensor(const std::string& name, std::vector<int64_t> shape, DType dtype = DType::F32,
                          uint64_t offset = 0);
// `tensors` in one source file (a path that does not exist: planning opens no file).
SourceSet one_file_source_set(std::vector<SourceTensor> tensors);

// Planner input with one output group, "model", that writes every tensor of `set` as it is named.
PlanInput one_group_input(const SourceSet& set);

// A plan writing `tensors` (their copies and folds set by the caller) into one safetensors
// file, offsets and sizes filled in as the planner would.
MergePlan one_file_plan(std::vector<OutputTensor> tensors, std::vector<SourceFile> sources);

}  // namespace shardmerge::test
