// Options shared by `plan`, `merge` and `verify`: verl's spellings and ours.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "exec/device.hpp"
#include "exec/dist/process_group.hpp"
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
  std::string hf_model_path;
  int verbose = 0;
};

void add_merge_options(CLI::App* cmd, MergeCliOptions& o);
MergeRequest to_request(const MergeCliOptions& o);

// How a plan is carried out and written (`merge`, `fold-lora`).
struct ExecCliOptions {
  std::string target = "tmp";  // verl's default
  unsigned threads = 0;
  std::string memory_limit = "512MiB";
  std::string device = "cpu";
  std::string gpu_memory = "auto";
  std::string profile;
  bool json = false;
  bool verify = false;
  bool force = false;
};

void add_exec_options(CLI::App* cmd, ExecCliOptions& o);

// --device and --gpu-memory (`merge`, `fold-lora`, `verify`), and the executor they choose.
void add_device_options(CLI::App* cmd, std::string& device, std::string& gpu_memory);
ChosenExecutor choose_executor(const std::string& device, const std::string& gpu_memory);
// Plans (timed as the "plan" phase), writes the output tree, optionally verifies, prints the summary.
int write_merge(const std::function<PlannedMerge()>& make_plan, const ExecCliOptions& o);

// The same, as one of several processes found by write_merge from the launcher's environment
// (torchrun, mpirun): each writes its share of the output files into one temp dir on a shared
// filesystem; rank 0 commits the tree and prints the summary.
int write_merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge()>& make_plan,
                            const ExecCliOptions& o, Executor& executor, const ExecOptions& exec);

}  // namespace shardmerge::cli
