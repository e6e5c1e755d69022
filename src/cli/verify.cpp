// `shardmerge verify` (verl's `test`): does an HF directory hold exactly what merging this
// checkpoint gives? And `shardmerge diff A B`: do two HF directories hold the same tensors?
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "formats/hf_index.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "util/units.hpp"
#include "verify/compare.hpp"

namespace shardmerge::cli {
namespace {

// `executor`: which one produced the expected bytes (verify), empty for diff.
int print_result(const TreeDiff& d, const std::string& what, bool as_json, const std::string& executor = "") {
  if (as_json) {
    nlohmann::ordered_json j;
    j["equal"] = d.equal();
    if (!executor.empty()) j["executor"] = executor;
    j["missing"] = d.missing;
    j["unexpected"] = d.unexpected;
    j["metadata_mismatch"] = d.mismatched_meta;
    auto& v = j["tensors"] = nlohmann::ordered_json::object();
    for (const auto& [name, t] : d.values)
      v[name] = {{"elements", t.elements}, {"mismatched", t.mismatched}, {"max_abs_error", t.max_abs_error}};
    std::cout << j.dump(2) << "\n";
  } else {
    if (!executor.empty()) std::printf("shardmerge: executor: %s\n", executor.c_str());
    for (const auto& l : d.report(50)) std::printf("%s\n", l.c_str());
    std::printf("shardmerge: %s: %s (%zu tensors compared)\n", what.c_str(), d.equal() ? "equal" : "DIFFERENT",
                d.values.size());
  }
  return d.equal() ? 0 : 1;
}

struct VerifyCli {
  MergeCliOptions common;
  std::string test_dir;
  double atol = 0;
  bool json = false;
  std::string device = "cpu";
  std::string gpu_memory = "auto";
};

int run_verify(const VerifyCli& o) {
  const ChosenExecutor chosen = choose_executor(o.device, o.gpu_memory);
  PlannedMerge pm = plan_merge(to_request(o.common));
  HfWeights reference = open_hf_weights(o.test_dir);
  CompareSink sink(pm.plan, reference, o.atol);
  chosen.executor->run(pm.plan, sink, ExecOptions{});
  return print_result(sink.result(), pm.role_dir + " vs " + o.test_dir, o.json, chosen.description);
}

}  // namespace

void add_verify(CLI::App& app, Runner& run) {
  for (const char* name : {"verify", "test"}) {
    auto* cmd = app.add_subcommand(name, std::string(name) == "test"
                                             ? "Same as verify (verl's spelling)"
                                             : "Check that an HF directory equals the merge of a checkpoint (keys, shapes, dtypes, values)");
    auto o = std::make_shared<VerifyCli>();
    add_merge_options(cmd, o->common);
    cmd->add_option("--test_hf_dir,--test-hf-dir", o->test_dir, "HF directory to check")->required();
    cmd->add_option("--atol", o->atol, "Accept floating-point differences up to this (default: bitwise)");
    cmd->add_flag("--json", o->json, "Print the result as JSON");
    add_device_options(cmd, o->device, o->gpu_memory);
    cmd->callback([&run, o] { run = [o] { return run_verify(*o); }; });
  }
}

void add_diff(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("diff", "Compare the tensors of two HF directories");
  auto a = std::make_shared<std::string>(), b = std::make_shared<std::string>();
  auto atol = std::make_shared<double>(0);
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("hf_a", *a, "First HF directory")->required();
  cmd->add_option("hf_b", *b, "Second HF directory")->required();
  cmd->add_option("--atol", *atol, "Accept floating-point differences up to this (default: bitwise)");
  cmd->add_flag("--json", *as_json, "Print the result as JSON");
  cmd->callback([&run, a, b, atol, as_json] {
    run = [a, b, atol, as_json] {
      HfWeights wa = open_hf_weights(*a), wb = open_hf_weights(*b);
      return print_result(diff_trees(wa, wb, *atol), *a + " vs " + *b, *as_json);
    };
  });
}

}  // namespace shardmerge::cli
