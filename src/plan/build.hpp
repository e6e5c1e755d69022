// From described sources to a MergePlan: output names (backend mappings), output dtypes,
// HF shard assignment, byte offsets, headers and sidecar files. Pure: opens no file.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "layouts/layout.hpp"
#include "geometry/source_set.hpp"
#include "shardmerge/plan.hpp"

namespace shardmerge {

// How the output dtype of floating-point tensors is chosen (integer and bool are never cast).
//   Default: fp32/fp64 -> bf16 as verl does; fp16 and bf16 keep their dtype (never a silent
//            16-bit -> 16-bit cast); a checkpoint holding both fp16 and bf16 must say --dtype.
//   Fixed:   `dtype` (a bf16 <-> fp16 cast is warned about); Auto: config.json's dtype; Keep: none.
enum class DTypePolicy { Default, Fixed, Auto, Keep };

struct OutputOptions {
  DTypePolicy dtype_policy = DTypePolicy::Default;
  DType dtype = DType::BF16;            // with Fixed
  uint64_t max_shard_size = 5'000'000'000;  // transformers v4 default ("5GB")
};

// One tensor of the output: where its data comes from, and an optional LoRA fold.
struct PlannedTensor {
  std::string name;
  const SourceTensor* source = nullptr;
  struct Fold {
    const SourceTensor* a = nullptr;  // [r, in]
    const SourceTensor* b = nullptr;  // [out, r]
    double scale = 0;
    bool fan_in_fan_out = false;
  };
  std::optional<Fold> fold;
  bool keep_dtype = false;  // written in its source dtype whatever the policy (adapter tensors)
  // Cut from part `storage.second` of this tensor together with others (per-expert parts of a
  // fused tensor): save_pretrained holds a part's experts as views of one storage, and
  // huggingface_hub's sharding keeps a storage's tensors in one shard, counting the storage once
  // where its first tensor comes.
  std::pair<const SourceTensor*, int64_t> storage = {nullptr, 0};
};

// A group of tensors written as one safetensors tree: the model (sharded, with an index) or
// an extra single file such as lora_adapter/adapter_model.safetensors.
struct OutputGroup {
  std::string file_stem;  // "model" -> model.safetensors / model-0000i-of-0000N.safetensors
  std::string subdir;     // "" or "lora_adapter"
  bool shard = true;      // split at max_shard_size and write an index
  // safetensors __metadata__: save_pretrained's for a model; none for verl's adapter_model.safetensors
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::vector<PlannedTensor> tensors;
};

struct PlanInput {
  const SourceSet* sources = nullptr;
  std::string source_dir;
  std::vector<OutputGroup> groups;
  const layouts::HfTree* hf = nullptr;  // config, tokenizer and other sidecars, if any
  std::vector<std::string> model_dirs = {""};  // output dirs that get hf's sidecars (each holds a model)
  std::vector<Sidecar> extra_sidecars;
  std::vector<std::string> notes;
};

MergePlan build_plan(const PlanInput& input, const OutputOptions& options);

// The output dtype `auto` resolves to: config.json's torch_dtype / dtype.
std::optional<DType> config_dtype(const nlohmann::ordered_json& config);

}  // namespace shardmerge
