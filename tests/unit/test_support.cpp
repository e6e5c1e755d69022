#include "test_support.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "formats/safetensors.hpp"
#include "geometry/sharding.hpp"

namespace shardmerge::test {

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  path_ = std::filesystem::temp_directory_path() /
          ("shardmerge-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

CommandResult run_shardmerge(const std::string& args) {
  CommandResult r;
  // SHARDMERGE_BIN in the environment wins: a build carried to another machine runs from another path.
  const char* env_bin = std::getenv("SHARDMERGE_BIN");
  const std::string cmd = std::string(env_bin && *env_bin ? env_bin : SHARDMERGE_BIN) + " " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

MergePlan one_file_plan(std::vector<OutputTensor> tensors, std::vector<SourceFile> sources) {
  MergePlan plan;
  plan.sources = std::move(sources);
  std::vector<TensorDecl> decls;
  for (const auto& t : tensors) decls.push_back({t.name, t.dtype, t.shape});
  const SafetensorsLayout layout = layout_safetensors(decls);
  plan.files.push_back({"model.safetensors", layout.header, layout.file_size});
  for (auto& t : tensors) {
    for (const auto& placed : layout.tensors)
      if (placed.name == t.name) {
        t.offset = placed.file_offset;
        t.nbytes = placed.nbytes;
      }
    plan.tensors.push_back(std::move(t));
  }
  return plan;
}

SourceTensor whole_tensor(const std::string& name, std::vector<int64_t> shape, DType dtype, uint64_t offset) {
  SourceTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = shape;
  t.pieces.push_back(dense_slice(0, offset, dtype, std::vector<int64_t>(shape.size(), 0), shape));
  return t;
}

SourceSet one_file_source_set(std::vector<SourceTensor> tensors) {
  SourceSet set;
  set.description = "test";
  SourceFile file;
  file.path = "/nonexistent/rank0.pt";
  file.size = 1 << 20;
  set.files.push_back(file);
  set.tensors = std::move(tensors);
  return set;
}

PlanInput one_group_input(const SourceSet& set) {
  OutputGroup g;
  g.file_stem = "model";
  for (const auto& t : set.tensors) g.tensors.push_back({t.name, &t, std::nullopt, false});
  PlanInput in;
  in.sources = &set;
  in.groups.push_back(std::move(g));
  return in;
}

}  // namespace shardmerge::test
