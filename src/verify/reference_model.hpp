// Which source elements each HF output tensor is made of, per element, for `verify`: HF names
// resolved from the reference tensors (PEFT/FSDP names; Megatron's name tables), and for
// Megatron the un-stacking, QKV per-group split, gate/up split and vocab trim as per-row index
// formulas written here, independently of plan/regions.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan/saved_names.hpp"
#include "verify/reference_assembly.hpp"

namespace shardmerge {

// Output element (o_0, o_1, ..., o_{n-1}) of a tensor of `shape` is element
// (lead..., row(o_0), o_1, ..., o_{n-1}) of `source`; a 0-d output is element (lead...).
struct SourceMap {
  const ReferenceTensor* source = nullptr;
  std::vector<int64_t> lead;
  std::function<int64_t(int64_t)> row;  // empty: the identity
  std::vector<int64_t> shape;
};

struct LoraPair {
  SourceMap a;  // [r, in] (lora_embedding_A: [r, num_embeddings])
  SourceMap b;  // [out, r] (lora_embedding_B: [dim, r])
  bool embedding = false;
};

struct ReferenceModel {
  ReferenceSources sources;
  std::map<std::string, SourceMap> weights;  // HF name -> its elements
  std::map<std::string, LoraPair> lora;      // HF module path -> its adapter
};

// FSDP rank files, or HF weights (+ a PEFT adapter's tensors, named as saved): PEFT and FSDP
// wrapper names resolved by plan/peft_names (names only, no arithmetic).
void map_peft_names(ReferenceModel& model, size_t adapter_begin);

// The save-time conversion the plan applied (plan/saved_names.hpp): the table says which names
// and which expert/part each saved tensor is; the element maps (expert index as the leading
// source index, the part's row offset) are written here, not taken from plan/regions. LoRA
// modules stay reachable under their run-time path (the adapter keeps PEFT's names) and their
// saved one (a fold targets the saved weight).
void map_saved_names(ReferenceModel& model, const SavedNameRules& rules);

// Megatron names (stacked or per layer) to HF names, with `config` the HF config.json.
void map_megatron_names(ReferenceModel& model, const nlohmann::ordered_json& config);

// TorchTitan names to HF names (plan/torchtitan_names' table; Llama's q/k rotary rows as an
// index formula written here). Grouped w1/w3 map straight to the saved per-expert names `rules`
// gives for transformers' fused gate_up_proj (w1 -> the gate part, w3 -> up); the rest keep
// run-time names for map_saved_names.
void map_torchtitan_names(ReferenceModel& model, const nlohmann::ordered_json& config, const SavedNameRules* rules);

}  // namespace shardmerge
