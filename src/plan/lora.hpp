// What to do with LoRA adapters: fold them into the base weights (W + scale * B @ A), export
// them as a PEFT adapter beside the unfolded base weights (verl's layout), both, or drop them.
// No output directory ever holds folded weights next to an adapter: loading that base with
// that adapter (PEFT, vLLM --enable-lora) would apply the LoRA twice. `both` therefore writes
// the folded model at the target's root and verl's layout in its own subtree (kUnfoldedDir).
// Scales follow PEFT: alpha / r, or alpha / sqrt(r) with rsLoRA, with per-module rank_pattern /
// alpha_pattern.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "plan/build.hpp"
#include "plan/peft_names.hpp"

namespace shardmerge {

struct SavedNameRules;

enum class LoraMode { Fold, Adapter, Both, Drop };
std::optional<LoraMode> lora_mode_from_string(const std::string& s);

// --lora both: the unfolded base model and its lora_adapter/ (verl's layout), under the target.
inline constexpr const char* kUnfoldedDir = "unfolded";

struct LoraConfig {
  std::optional<int64_t> r;
  std::optional<double> alpha;
  bool use_rslora = false;
  bool fan_in_fan_out = false;
  std::map<std::string, int64_t> rank_pattern;
  std::map<std::string, double> alpha_pattern;
  std::string task_type;
  std::string source;                // file the values came from
  nlohmann::ordered_json adapter_config;  // the original adapter_config.json, if any
};

// Reads adapter_config.json (PEFT) or lora_train_meta.json (verl); refuses PEFT types and
// options we cannot reproduce exactly (DoRA, non-LoRA methods, lora_bias).
LoraConfig lora_config_from_adapter_config(const nlohmann::json& config, const std::string& source);
LoraConfig lora_config_from_train_meta(const nlohmann::json& meta, const std::string& source);

// PEFT's scaling for one module (its HF path), given the rank its tensors have.
double lora_scale(const LoraConfig& config, const std::string& module, int64_t rank);

struct ModelGroupsInput {
  const PeftSplit* split = nullptr;
  LoraMode mode = LoraMode::Fold;
  std::optional<LoraConfig> config;  // needed for fold and adapter when LoRA is present
  std::optional<double> alpha_override;  // --lora-alpha
  bool drop_tied_lm_head = false;
  // --force-lora-alpha: --lora-alpha may replace a non-zero alpha the checkpoint records.
  bool force_alpha = false;
  // The base weights carry saved names (an HF model's) and the LoRA modules run-time ones: a
  // module's base weight is its saved name under these rules. nullptr: the same names.
  const SavedNameRules* base_saved_names = nullptr;
};

struct ModelGroups {
  OutputGroup model;                      // at the target's root: folded, unless --lora adapter/drop
  std::optional<OutputGroup> unfolded;    // --lora both: the base weights in kUnfoldedDir/
  std::optional<OutputGroup> adapter;     // [unfolded/]lora_adapter/adapter_model.safetensors
  std::optional<Sidecar> adapter_config;  // [unfolded/]lora_adapter/adapter_config.json
  std::vector<std::string> notes;

  // Output directories that each hold an HF model and so get config.json and the tokenizer.
  std::vector<std::string> model_dirs() const;
};

ModelGroups make_model_groups(const ModelGroupsInput& input);

// A summary line per mode, for `inspect`.
std::vector<std::string> describe_lora(const PeftSplit& split, const std::optional<LoraConfig>& config);

}  // namespace shardmerge
