// Options shared by `plan`, `merge` and `verify`: verl's spellings and ours.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "exec/device.hpp"
#include "exec/dist/process_group.hpp"
#include "pipeline/planner.hpp"

namespace shardmerge::cli {

struct MergeCliOptions {
  std::string local_dir;
  std::string backend = "auto";
  std::string dtype = "default";
  std::string max_shard_size = "5GB";
  std::string lora = "fold";
  double lora_alpha = 0;
  bool force_lora_alpha = false;
  bool tie_word_embedding = false;
  bool is_value_model = false;
  bool trust_remote_code = false;  // accepted for verl compatibility: nothing is executed anyway
  std::string role = "actor";
  std::string hf_model_path;
  int verbose = 0;
};

void add_merge_options(CLI::App* cmd, MergeCliOptions& o);

// --dtype's values, and the output options one of them selects (`merge`, `plan`, `verify`, `fold-lora`).
inline const std::vector<std::string> kDTypeChoices = {"default", "auto", "bf16",    "bfloat16", "fp16",
                                                       "float16", "fp32", "float32", "keep"};
OutputOptions output_dtype_options(const std::string& dtype);
// --lora-alpha and --force-lora-alpha (`merge`, `plan`, `verify`, `fold-lora`).
void add_lora_alpha_options(CLI::App* cmd, double& alpha, bool& force);
MergeRequest to_request(const MergeCliOptions& o);
// The planning options as given, for the reader of a plan file.
nlohmann::ordered_json planning_options_json(const MergeCliOptions& o);

// How a plan is carried out and written (`merge`, `fold-lora`).
struct ExecCliOptions {
  std::string target;  // empty: verl's default, kDefaultTarget, said on stderr
  unsigned threads = 0;
  std::string memory_limit = "512MiB";
  std::string device = "cpu";
  std::string gpu_memory = "auto";
  std::string profile;
  bool json = false;
  bool verify = false;
  bool force = false;
  bool no_crc = false;
  int verbose = 0;  // the subcommand's -v: phase timings and one line per output tensor
};
inline const std::string kDefaultTarget = "tmp";  // verl's model_merger writes here without --target_dir

void add_exec_options(CLI::App* cmd, ExecCliOptions& o);

// --device and --gpu-memory (`merge`, `fold-lora`, `verify`), and the executor they choose.
void add_device_options(CLI::App* cmd, std::string& device, std::string& gpu_memory);
// A byte size as parse_size reads it ("5GB", "500MiB"), positive; "auto" too where allowed. A bad
// value fails parsing, so the error names the flag and exits 2.
CLI::Validator byte_size_check(bool allow_auto = false);
ChosenExecutor choose_executor(const std::string& device, const std::string& gpu_memory, const Workload& workload);
// Plans (timed as the "plan" phase), writes the output tree, optionally verifies, prints the summary.
int write_merge(const std::function<PlannedMerge()>& make_plan, const ExecCliOptions& o);

// The same, as one of several processes found by write_merge from the launcher's environment
// (torchrun, mpirun): each writes its share of the output files into one temp dir on a shared
// filesystem; rank 0 commits the tree and prints the summary.
int write_merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge()>& make_plan,
                            const ExecCliOptions& o, Executor& executor, const ExecOptions& exec);

}  // namespace shardmerge::cli
