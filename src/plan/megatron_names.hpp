// Megatron-Core tensor names to HuggingFace names, one table per model family: each rule maps
// a Megatron name (per layer) to an HF name and says how to split the tensor (QKV per query
// group, fc1 into gate/up halves, padded vocab rows trimmed). Layer-stacked keys
// (`decoder.layers.X` with a leading [L] axis, experts [L, E]) are un-stacked first.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "geometry/source_set.hpp"

namespace shardmerge {

struct MegatronMapOptions {
  bool value_model = false;         // output_layer [1, H] -> score.weight
  bool tie_word_embedding = false;  // drop output_layer even if config.json does not tie
};

struct HfTensors {
  std::vector<SourceTensor> tensors;  // HF names, in HF state-dict order
  std::vector<std::string> notes;
};

// `megatron` holds Megatron names (stacked or per-layer); `config` is the HF config.json.
// Unknown architectures and unknown keys are errors that list them.
HfTensors map_megatron_to_hf(const SourceSet& megatron, const nlohmann::ordered_json& config,
                             const MegatronMapOptions& options);

// One row of an architecture's table, for readers that map names on their own (verify):
// `megatron` is the per-layer name after "decoder.layers.<l>." ("*" stands for an expert id),
// `hf` the name after "model.layers.<l>." ("*" the expert id, "{}" the split part). A
// multi-token-prediction layer `mtp.layers.<i>` is HF layer num_hidden_layers + i: its
// `transformer_layer.<name>` maps by the decoder rows, its own modules by rows named "mtp.<name>".
struct MegatronNameRule {
  enum class Split { None, Qkv, GateUp, QkvHeads } split = Split::None;
  std::string megatron;
  std::string hf;
  std::vector<std::string> parts;  // what "{}" in `hf` becomes, part by part (q/k/v, gate/up, w1/w3)
};
// The table of `architecture`; empty when there is none.
std::vector<MegatronNameRule> megatron_name_rules(const std::string& architecture);

// A multimodal architecture's language-model key prefix (e.g. "language_model."); "" for a text model.
std::string megatron_language_prefix(const std::string& architecture);

// A vision tower beside the language model: `megatron` is its key prefix ("vision_model."), its
// blocks `<megatron>decoder.layers.<l>.<rule>` are HF `<hf_blocks><l>.<rule's hf>`; QkvHeads
// regroups a fused qkv from Megatron's per-head [q_h, k_h, v_h] rows into HF's [q; k; v].
struct MegatronVisionTower {
  std::string megatron;
  std::string hf_blocks;
  std::vector<MegatronNameRule> rules;
  std::vector<std::pair<std::string, std::string>> globals;  // after `megatron` -> HF name
};
std::optional<MegatronVisionTower> megatron_vision_tower(const std::string& architecture);

// The architectures (config.json `architectures[0]`) that have a table.
std::vector<std::string> megatron_supported_architectures();

}  // namespace shardmerge
