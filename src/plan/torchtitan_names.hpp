// TorchTitan's model names to HuggingFace names, one table per model family, as TorchTitan's
// own state-dict adapters (`to_hf`) convert them: renames, Llama's rotary row order of q/k
// (TorchTitan keeps each head's rows interleaved, HF the two halves). Grouped experts become
// transformers' run-time fused tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`), which
// the save-time name table (plan/saved_names.hpp) then writes per expert as save_pretrained does.
// TorchTitan 0.2's names (`attention.wq`, `output`) and 0.3's (`attention.qkv_linear.wq`,
// `lm_head`, `moe.routed_experts.inner_experts.w1_EFD`).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "geometry/source_set.hpp"
#include "plan/megatron_names.hpp"

namespace shardmerge {

// `titan` holds the model tensors of a TorchTitan checkpoint (training state left out);
// `config` is the HF config.json of the model. Unknown model types and unknown keys are errors
// that list them.
HfTensors map_torchtitan_to_hf(const SourceSet& titan, const nlohmann::ordered_json& config);

// A TorchTitan name as the tables match it: "layers.<l>.<rest>" gives (l, rest); any other
// name (nullopt, name).
struct TorchTitanName {
  std::optional<int64_t> layer;
  std::string rest;
};
TorchTitanName split_torchtitan_name(const std::string& name);

// One row of a family's table, for readers that map names on their own (verify): `titan` and
// `hf` after "layers.<l>." / "model.layers.<l>." when `layer`, whole names otherwise.
struct TorchTitanNameRule {
  enum class Op { Copy, QRows, KRows, Gate, Up, Drop } op = Op::Copy;
  std::string titan;
  std::string hf;
  bool layer = true;
};
// The rows for the config's model_type; throws for a model type without a table.
std::vector<TorchTitanNameRule> torchtitan_name_rules(const nlohmann::ordered_json& config);

}  // namespace shardmerge
