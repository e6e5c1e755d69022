// The host side of a merge: from a path on disk and the user's options to a MergePlan.
// Dispatches on the detected layout (FSDP role dir today; Megatron and HF+adapter alongside).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "geometry/source_set.hpp"
#include "layouts/node_local.hpp"
#include "plan/build.hpp"
#include "plan/lora.hpp"
#include "plan/saved_names.hpp"

namespace shardmerge {

struct MergeRequest {
  std::string local_dir;     // role dir, step root or run root
  std::string backend = "auto";  // auto | fsdp | megatron
  std::string role = "actor";    // followed from a run or step root
  OutputOptions output;
  LoraMode lora = LoraMode::Fold;
  std::optional<double> lora_alpha;
  bool force_lora_alpha = false;  // lora_alpha may replace the alpha the checkpoint records
  bool tie_word_embedding = false;  // verl's flag: drop lm_head even if config.json does not say tied
  bool is_value_model = false;
  std::string hf_model_path;  // config/tokenizer source replacing the checkpoint's huggingface/
  // FSDP rank files hold transformers' run-time names; by default they are written as the model's
  // save_pretrained names them (plan/saved_names.hpp). True keeps the run-time names.
  bool runtime_names = false;
  // A node-local multi-process merge: local_dir is a NodeLocalView's directory, and the data
  // files' summaries come from the processes that hold them.
  const layouts::GatheredSummaries* gathered = nullptr;
};

struct PlannedMerge {
  MergePlan plan;
  std::string role_dir;
  std::vector<std::string> lora_summary;  // for inspect
  SourceSet sources;                      // what the plan's slices point into
  std::vector<std::string> other_source_dirs;  // besides role_dir: never written into (fold-lora's base)
  // The save-time name conversion the plan applied (FSDP rank files of a class that converts);
  // verify reads it.
  const SavedNameRules* saved_names = nullptr;
};

PlannedMerge plan_merge(const MergeRequest& request);

// `fold-lora`: a PEFT adapter directory folded into an HF model directory.
struct FoldLoraRequest {
  std::string base_dir;
  std::string adapter_dir;
  OutputOptions output;
  LoraMode lora = LoraMode::Fold;
  std::optional<double> lora_alpha;
  bool force_lora_alpha = false;
};
PlannedMerge plan_fold_lora(const FoldLoraRequest& request);

}  // namespace shardmerge
