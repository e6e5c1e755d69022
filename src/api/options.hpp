// The options of `plan`, `merge`, `verify` and `fold-lora` as values, shared by the CLI (which
// fills them from flags) and the Python API (from keyword arguments), and their checks: a bad
// value is a usage_error naming the option by its CLI flag.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "exec/device.hpp"
#include "exec/dist/data_plane.hpp"
#include "pipeline/planner.hpp"

namespace shardmerge::api {

// What decides the plan: verl's merger options and ours.
struct MergeOptions {
  std::string local_dir;
  std::string backend = "auto";
  std::string dtype = "default";
  std::string max_shard_size = "5GB";
  std::string lora = "fold";
  double lora_alpha = 0;  // 0: the checkpoint's
  bool force_lora_alpha = false;
  bool tie_word_embedding = false;
  bool is_value_model = false;
  std::string role = "actor";
  std::string hf_model_path;
  bool runtime_names = false;  // keep the rank files' run-time names (no save-time conversion)
};

inline const std::vector<std::string> kBackendChoices = {"auto", "fsdp", "megatron"};
inline const std::vector<std::string> kDTypeChoices = {"default", "auto", "bf16",    "bfloat16", "fp16",
                                                       "float16", "fp32", "float32", "keep"};
inline const std::vector<std::string> kLoraChoices = {"fold", "adapter", "both", "drop"};

// --dtype's value as the output options it selects.
OutputOptions output_dtype_options(const std::string& dtype);
MergeRequest to_request(const MergeOptions& o);
// The planning options as given, for the reader of a plan file.
nlohmann::ordered_json planning_options_json(const MergeOptions& o);

// What decides a fold-lora plan: a PEFT adapter folded into an HF model.
struct FoldLoraOptions {
  std::string base;
  std::string adapter;
  std::string dtype = "auto";  // config.json's torch_dtype
  std::string max_shard_size = "5GB";
  double lora_alpha = 0;  // 0: the adapter's
  bool force_lora_alpha = false;
};
FoldLoraRequest to_request(const FoldLoraOptions& o);

// How a plan is carried out and written (`merge`, `fold-lora`).
struct WriteOptions {
  std::string target;  // empty: verl's default, kDefaultTarget, said on stderr
  unsigned threads = 0;
  std::string memory_limit = "512MiB";
  std::string device = "cpu";
  std::string gpu_memory = "auto";
  std::string profile;  // a Chrome trace of the phases is written here
  bool verify = false;
  bool force = false;
  bool no_crc = false;
  // Join the processes a launcher started (torchrun, mpirun: RANK and WORLD_SIZE in the
  // environment) as one multi-process merge. The CLI does; the Python API only when asked, since
  // a training job's processes carry those variables too.
  bool multi_process = true;
  // What moves slices between the processes of a multi-process merge: auto, mpi or nccl
  // (exec/dist/data_plane.hpp).
  std::string transport = "auto";
  // Seconds a process of a multi-process merge waits for a peer that answers nothing (stopped,
  // or its link down) before the job fails naming it (the MPI transport).
  double peer_timeout = 300;
};
using dist::kTransportChoices;  // --transport's values
inline const std::string kDefaultTarget = "tmp";  // verl's model_merger writes here without --target_dir

// The executor --device and --gpu-memory choose for `workload`.
ChosenExecutor choose_executor(const std::string& device, const std::string& gpu_memory, const Workload& workload);

// A byte size as parse_size reads it ("5GB", "500MiB"), positive, else a usage_error naming `flag`.
uint64_t positive_size(const std::string& flag, const std::string& text);

}  // namespace shardmerge::api
