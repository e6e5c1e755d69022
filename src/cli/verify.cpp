// `shardmerge verify` (verl's `test`): does an HF directory hold exactly what merging this
// checkpoint gives? And `shardmerge diff A B`: do two HF models, PEFT adapters or safetensors
// files hold the same tensors?
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "api/verify.hpp"
#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "formats/hf_index.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "util/file.hpp"
#include "util/units.hpp"
#include "verify/compare.hpp"

namespace shardmerge::cli {
namespace {

using json = nlohmann::json;

// `what_was_compared`: verify's one line on its route, empty for diff. `verbose`: a line for every
// tensor compared, equal or not.
int print_result(const TreeDiff& d, const std::string& what, bool as_json, const std::string& what_was_compared = "",
                 int verbose = 0) {
  if (as_json) {
    std::cout << api::tree_diff_json(d, what_was_compared).dump(2) << "\n";
  } else {
    if (verbose > 0)
      for (const auto& [name, t] : d.values) {
        const std::string state = t.mismatched ? std::to_string(t.mismatched) + " of " + std::to_string(t.elements) +
                                                     " elements differ, max abs error " + std::to_string(t.max_abs_error)
                                               : std::to_string(t.elements) + " elements equal";
        std::printf("  %s: %s\n", name.c_str(), state.c_str());
      }
    for (const auto& l : d.compared_as_fp32) std::printf("compared as fp32: %s\n", l.c_str());
    for (const auto& l : d.report(50)) std::printf("%s\n", l.c_str());
    if (!what_was_compared.empty()) std::printf("shardmerge: %s\n", what_was_compared.c_str());
    std::printf("shardmerge: %s: %s (%zu tensors compared)\n", what.c_str(), d.equal() ? "equal" : "DIFFERENT",
                d.values.size());
  }
  return d.equal() ? 0 : 1;
}

// One side of `diff`: its tensors and, for a PEFT adapter, its adapter_config.json (r and alpha
// change what the same tensors mean).
struct DiffSide {
  HfWeights weights;
  json adapter_config;
};

HfWeights open_single_file(const std::string& path) {
  HfWeights w;
  w.dir = std::filesystem::path(path).parent_path().string();
  w.files.push_back(SafetensorsFile::open(path));
  for (const auto& t : w.files[0].tensors()) w.tensors.emplace(t.name, HfWeights::Ref{0, &t});
  return w;
}

DiffSide open_diff_side(const std::string& path) {
  namespace fs = std::filesystem;
  DiffSide side;
  const fs::path dir(path);
  std::error_code ec;
  if (fs::is_regular_file(dir, ec)) {
    side.weights = open_single_file(path);
    return side;
  }
  const bool model = fs::exists(dir / "model.safetensors", ec) || fs::exists(dir / "model.safetensors.index.json", ec);
  if (model || !fs::exists(dir / "adapter_config.json", ec)) {
    side.weights = open_hf_weights(path);
    return side;
  }
  const fs::path weights = dir / "adapter_model.safetensors";
  if (!fs::is_regular_file(weights, ec))
    throw Error("PEFT adapter without adapter_model.safetensors (only safetensors adapters can be compared)").file(path);
  side.weights = open_single_file(weights.string());
  const std::string config_path = (dir / "adapter_config.json").string();
  try {
    side.adapter_config = json::parse(read_small_file(config_path));
  } catch (const json::exception& e) {
    throw Error(std::string("not valid JSON: ") + e.what()).file(config_path);
  }
  return side;
}

// Top-level keys whose values differ (or that one side lacks).
std::vector<std::string> differing_keys(const json& a, const json& b) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : a.items())
    if (!b.contains(k) || b[k] != v) keys.push_back(k);
  for (const auto& [k, v] : b.items())
    if (!a.contains(k)) keys.push_back(k);
  return keys;
}

struct VerifyCli {
  MergeCliOptions common;
  api::VerifyOptions verify;
  bool json = false;
};

int run_verify(VerifyCli o) {
  o.verify.merge = o.common.plan;
  const api::VerifyOutcome v = api::verify(o.verify);
  return print_result(v.check.diff, v.role_dir + " vs " + o.verify.test_hf_dir, o.json, v.check.summary(),
                      o.common.verbose);
}

}  // namespace

void add_verify(CLI::App& app, Runner& run) {
  for (const char* name : {"verify", "test"}) {
    auto* cmd = app.add_subcommand(name, std::string(name) == "test"
                                             ? "Same as verify (verl's spelling)"
                                             : "Check that an HF directory equals the merge of a checkpoint (keys, shapes, dtypes, values)");
    auto o = std::make_shared<VerifyCli>();
    add_merge_options(cmd, o->common);
    cmd->add_option("--test_hf_dir,--test-hf-dir", o->verify.test_hf_dir, "HF directory to check")
        ->required()
        ->check(CLI::ExistingDirectory);
    cmd->add_option("--atol", o->verify.atol, "Accept floating-point differences up to this (0: bitwise)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_flag("--json", o->json, "Print the result as JSON");
    cmd->callback([&run, o] { run = [o] { return run_verify(*o); }; });
  }
}

void add_diff(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "diff", "Compare the tensors of two HF model directories, PEFT adapter directories or .safetensors files");
  auto a = std::make_shared<std::string>(), b = std::make_shared<std::string>();
  auto atol = std::make_shared<double>(0);
  auto as_json = std::make_shared<bool>(false);
  auto verbose = std::make_shared<int>(0);
  const char* what = "HF model directory, PEFT adapter directory (adapter_model.safetensors) or .safetensors file";
  cmd->add_option("hf_a", *a, std::string("First ") + what)->required()->check(CLI::ExistingPath);
  cmd->add_option("hf_b", *b, std::string("Second ") + what)->required()->check(CLI::ExistingPath);
  cmd->add_option("--atol", *atol,
                  "Accept floating-point differences up to this; values are then compared as fp32, so tensors of "
                  "different float dtypes are compared too (0: bitwise)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", *as_json, "Print the result as JSON");
  cmd->add_flag("-v,--verbose", *verbose, "A line for every tensor compared, equal or not");
  cmd->callback([&run, a, b, atol, as_json, verbose] {
    run = [a, b, atol, as_json, verbose] {
      const DiffSide sa = open_diff_side(*a), sb = open_diff_side(*b);
      TreeDiff d = diff_trees(sa.weights, sb.weights, *atol);
      if (sa.adapter_config.is_object() && sb.adapter_config.is_object())
        for (const auto& key : differing_keys(sa.adapter_config, sb.adapter_config))
          d.mismatched_meta.push_back("adapter_config.json: \"" + key + "\" is " + sa.adapter_config.value(key, json()).dump() +
                                      " vs " + sb.adapter_config.value(key, json()).dump());
      return print_result(d, *a + " vs " + *b, *as_json, "", *verbose);
    };
  });
}

}  // namespace shardmerge::cli
