// What a model class's own `save_pretrained` writes, given the run-time state_dict names that
// FSDP rank files hold. transformers 5 converts some checkpoints on load (a VLM's language model
// moved under `model.language_model.`, per-expert MoE weights fused into one [E, ...] tensor) and
// reverts that conversion on save, so hub checkpoints, older transformers and serving engines
// see the saved names. This is that revert, as data: one rule set per family, a table of model
// classes naming their family. The rules follow transformers 5.24's conversion mapping; the test
// SavedNames.AgreesWithTransformers checks them against what transformers itself writes.
#pragma once

#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "plan/build.hpp"

namespace shardmerge {

// A dotted path replaced by another, matched at name-segment boundaries, first occurrence
// (anywhere, or only at the start of the name).
struct NameRename {
  std::string_view runtime;
  std::string_view saved;
  bool at_start = false;
};

// A fused expert tensor `<prefix>.<fused>` of shape [E, k*R, C] saved as k*E tensors
// `<prefix>.<saved[j] with '*' = e>` of shape [R, C]: part j of expert e is rows [j*R, (j+1)*R)
// of slab e. Outputs come expert by expert, parts in order within an expert.
struct ExpertSplit {
  std::string_view fused;               // e.g. "mlp.experts.gate_up_proj"
  std::vector<std::string_view> saved;  // e.g. {"mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"}
};

struct SavedNameRules {
  std::string_view family;  // for inspect and notes, e.g. "per-expert MoE weights (qwen2_moe)"
  std::vector<ExpertSplit> splits;    // tried first, on the run-time name
  std::vector<NameRename> renames;    // then applied in order, to every name
  // transformers converts this class with operations shardmerge does not reproduce: a merge
  // refuses it (naming the class) unless the run-time names are asked for.
  bool refused = false;
  bool converts() const { return !splits.empty() || !renames.empty(); }
};

// One row of the model-class table: a class (config.json's `architectures[0]`) and its
// model_type, with the rules its save applies (nullptr: saved as at run time, on purpose).
struct SavedNameClass {
  std::string_view architecture;
  std::string_view model_type;
  const SavedNameRules* rules = nullptr;
};

// The table row for a config.json: by `architectures[0]`, else by `model_type`; nullptr when
// the table has no row (the class converts nothing, as far as transformers 5.24 says).
const SavedNameClass* saved_name_class(const nlohmann::ordered_json& config);

// What one run-time tensor is saved as: its new name, and the box of the run-time tensor it
// takes (all of it unless split; a split drops the leading expert dim).
struct SavedPart {
  std::string name;
  std::vector<int64_t> start;
  std::vector<int64_t> extent;
  size_t drop = 0;  // leading dims of the box that the saved tensor does not have
};
// Throws when a fused tensor's shape does not split (not 3-D, rows not divisible).
std::vector<SavedPart> saved_parts(const SavedNameRules& rules, const std::string& runtime_name,
                                   const std::vector<int64_t>& shape);

// A run-time name only transformers 5 writes (a fused expert tensor, a VLM's
// `model.language_model.` prefix): for a class the table does not know, a merge must not copy it
// silently.
bool looks_like_runtime_name(const std::string& name, const std::vector<int64_t>& shape);

// Renames `group`'s tensors (named as at run time) to their saved names, in the order
// save_pretrained writes them, replacing each fused tensor by its per-expert parts: new
// SourceTensors cut from it (plain slice arithmetic, so every executor, plan files, node-local
// merges and --verify see ordinary tensors), kept in `parts`, which must outlive the plan's
// building. A LoRA fold into a fused tensor is refused.
void apply_saved_names(OutputGroup& group, const SavedNameRules& rules, std::deque<SourceTensor>& parts);

// The module patterns a model class keeps in float32 when it is loaded in a 16-bit dtype
// (transformers' `_keep_in_fp32_modules_strict`: routers, expert score biases and the like), so
// that its save_pretrained writes those tensors as float32 in a bf16 or fp16 checkpoint. Patterns
// are matched as transformers matches them: searched anywhere in the name, '.' any character,
// '*' any run of characters. Empty for a class that keeps nothing in float32 (or is unknown).
// SavedNames.KeepsTransformersFp32Tensors checks the table against transformers.
std::vector<std::string_view> fp32_module_patterns(std::string_view architecture);
bool kept_in_fp32(const std::vector<std::string_view>& patterns, std::string_view name);

// transformers' `dot_natural_key` order (save_pretrained sorts by it when it converts):
// dotted parts compared as numbers when they are digits, else as text then trailing number.
bool dot_natural_less(const std::string& a, const std::string& b);

}  // namespace shardmerge
