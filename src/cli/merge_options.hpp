// Options shared by `plan`, `merge` and `verify`: verl's spellings and ours.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "plan/planner.hpp"

namespace shardmerge::cli {

struct MergeCliOptions {
  std::string local_dir;
  std::string backend = "auto";
  std::string dtype = "bf16";
  std::string max_shard_size = "5GB";
  std::string lora = "both";
  double lora_alpha = 0;
  bool tie_word_embedding = false;
  bool is_value_model = false;
  bool trust_remote_code = false;  // accepted for verl compatibility: nothing is executed anyway
  std::string role = "actor";
  int verbose = 0;
};

void add_merge_options(CLI::App* cmd, MergeCliOptions& o);
MergeRequest to_request(const MergeCliOptions& o);

}  // namespace shardmerge::cli
