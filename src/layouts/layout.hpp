// What a path on disk is: a verl run root, a step root, an FSDP or Megatron role directory,
// a HuggingFace model tree, a PEFT adapter, or unknown. Detection reads names, small JSON
// files and directory listings only; describing the tensors (src/layouts/<backend>.cpp)
// reads pickles and headers, never tensor data.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace shardmerge::layouts {

struct HfTree {
  std::string path;
  bool has_config = false;
  nlohmann::ordered_json config;  // config.json, when present and valid
  std::string config_problem;     // "<path>: ..." when config.json is there but not a valid JSON object
  std::string architecture;       // architectures[0]
  enum class Weights { None, Safetensors, ShardedSafetensors, PytorchBin } weights = Weights::None;
  bool weights_complete = false;  // every shard named by the index exists and is non-empty
  std::vector<std::string> weight_files;
  std::vector<std::string> missing_shards;
  std::vector<std::string> sidecar_files;  // config, tokenizer, processor, chat template, *.py ...
};

struct PeftAdapter {
  std::string path;
  nlohmann::json config;        // adapter_config.json
  std::string weights_file;     // adapter_model.safetensors or adapter_model.bin
};

struct FsdpRole {
  std::string path;
  int64_t world_size = 0;
  std::string world_size_source;            // "fsdp_config.json" or "rank file names"
  std::vector<int64_t> rank_file_world_sizes;  // every world size in the rank file names
  int fsdp_version = 0;                     // 0 when unknown
  std::vector<std::string> rank_files;      // index = rank; empty string where missing
  std::vector<int64_t> missing_ranks;
  int optim_files = 0;
  int extra_state_files = 0;
  std::optional<HfTree> huggingface;
  std::optional<nlohmann::json> lora_train_meta;
  std::optional<PeftAdapter> lora_adapter;
};

struct MegatronRole {
  std::string path;
  std::string layout;  // "v2 manifest", "v2 (no manifest)", "v1 dist_ckpt", "legacy mp_rank"
  std::optional<nlohmann::json> manifest;
  std::string manifest_name;
  std::string model_format;  // "megatron_dist_checkpoint" or "huggingface"
  std::string dist_ckpt;     // model dist_ckpt dir, if any
  std::optional<HfTree> huggingface;
  bool has_transformer_config = false;
  std::vector<std::string> mp_rank_dirs;
  std::string peft_adapter;  // the HF PEFT adapter a bridge exports (huggingface/adapter), if any

  // A PEFT save through Megatron-Bridge: the HF model dir holds the adapter and no base weights.
  bool adapter_only() const {
    return model_format == "huggingface" && huggingface && !huggingface->weights_complete && !peft_adapter.empty();
  }
};

// What verl's NeMo-Automodel engine saves (its Checkpointer, safetensors format, consolidated):
// model/ holds the training processes' safetensors shards (torch DCP's HuggingFace storage,
// `shard-RRRRR-model-FFFFF-of-NNNNN.safetensors`), model/consolidated/ the whole HF model made of
// them (weights, index, config, tokenizer), optim/ the optimizer as torch DCP.
struct AutomodelRole {
  std::string path;
  std::optional<HfTree> consolidated;  // model/consolidated
  int shard_files = 0;                 // model/shard-*.safetensors
  bool has_optimizer = false;          // optim/.metadata
};

// What verl's TorchTitan engine saves: TorchTitan's CheckpointManager writes one torch DCP
// checkpoint, `step-N/` (in the step directory: the engine points its folder there), holding the
// model under TorchTitan's own names beside the optimizer, scheduler and dataloader states.
struct TorchTitanCheckpoint {
  std::string path;  // the step-N directory
  std::optional<int64_t> step;
};

struct StepRoot {
  std::string path;
  std::optional<int64_t> step;
  std::vector<std::string> roles;  // role sub-directories that hold a checkpoint
  bool has_dataloader_state = false;
  std::optional<std::string> torchtitan;  // a TorchTitan step-N checkpoint inside, if any
};

struct RunRoot {
  std::string path;
  std::vector<std::pair<int64_t, std::string>> steps;  // sorted by step
  std::optional<int64_t> tracker_step;                 // latest_checkpointed_iteration.txt
  std::string tracker_problem;                         // why the tracker cannot be used
};

enum class Kind { RunRoot, StepRoot, FsdpRole, MegatronRole, AutomodelRole, TorchTitan, HfTree, PeftAdapter, Unknown };
const char* kind_name(Kind k);

struct Layout {
  Kind kind = Kind::Unknown;
  std::string path;
  std::vector<std::string> warnings;
  std::variant<std::monostate, RunRoot, StepRoot, FsdpRole, MegatronRole, AutomodelRole, TorchTitanCheckpoint, HfTree,
               PeftAdapter>
      info;
};

// Throws a usage Error (exit 2) when the path does not exist.
Layout detect(const std::string& path);

// For commands that take a role dir: follows a run root (tracker's latest step) or a step
// root down to its `role` directory (default actor), saying so in `notes`.
std::string resolve_role_dir(const std::string& path, const std::string& role, std::vector<std::string>& notes);

HfTree read_hf_tree(const std::string& path);

}  // namespace shardmerge::layouts
