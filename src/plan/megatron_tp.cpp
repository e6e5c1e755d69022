#include "plan/megatron_tp.hpp"

#include <algorithm>
#include <array>
#include <string>

#include "shardmerge/error.hpp"
#include "util/text.hpp"

namespace shardmerge {
namespace {

struct LegacyTpRule {
  std::string_view module;  // the name's last module component
  std::string_view param;   // "*": every parameter of the module
  LegacyTpSplit split;
};

// megatron-core's GPT layers (VocabParallelEmbedding, Column/RowParallelLinear and their TE
// twins with a fused layer norm, TopKRouter, the shared experts' gate) and the norms.
constexpr std::array kLegacyTpRules{
    LegacyTpRule{"word_embeddings", "weight", LegacyTpSplit::Dim0},
    LegacyTpRule{"position_embeddings", "weight", LegacyTpSplit::Replicated},
    LegacyTpRule{"output_layer", "weight", LegacyTpSplit::Dim0},
    LegacyTpRule{"linear_qkv", "weight", LegacyTpSplit::Dim0},
    LegacyTpRule{"linear_qkv", "bias", LegacyTpSplit::Dim0},
    LegacyTpRule{"linear_qkv", "layer_norm_weight", LegacyTpSplit::Replicated},
    LegacyTpRule{"linear_qkv", "layer_norm_bias", LegacyTpSplit::Replicated},
    LegacyTpRule{"linear_proj", "weight", LegacyTpSplit::Dim1},
    LegacyTpRule{"linear_proj", "bias", LegacyTpSplit::Replicated},  // added after the all-reduce
    LegacyTpRule{"linear_fc1", "weight", LegacyTpSplit::GateUp},
    LegacyTpRule{"linear_fc1", "bias", LegacyTpSplit::GateUp},
    LegacyTpRule{"linear_fc1", "layer_norm_weight", LegacyTpSplit::Replicated},
    LegacyTpRule{"linear_fc1", "layer_norm_bias", LegacyTpSplit::Replicated},
    LegacyTpRule{"linear_fc2", "weight", LegacyTpSplit::Dim1},
    LegacyTpRule{"linear_fc2", "bias", LegacyTpSplit::Replicated},
    LegacyTpRule{"router", "*", LegacyTpSplit::Replicated},
    LegacyTpRule{"shared_experts", "gate_weight", LegacyTpSplit::Replicated},
    LegacyTpRule{"input_layernorm", "*", LegacyTpSplit::Replicated},
    LegacyTpRule{"pre_mlp_layernorm", "*", LegacyTpSplit::Replicated},
    LegacyTpRule{"q_layernorm", "*", LegacyTpSplit::Replicated},
    LegacyTpRule{"k_layernorm", "*", LegacyTpSplit::Replicated},
    LegacyTpRule{"final_layernorm", "*", LegacyTpSplit::Replicated},
};

// "….experts.<e>.<module>.<param>": an expert's own weight.
bool is_expert_weight(std::string_view name, std::string_view module_and_param) {
  std::string_view head = name.substr(0, name.size() - module_and_param.size());
  if (head.empty() || head.back() != '.') return false;
  head.remove_suffix(1);
  const size_t dot = head.rfind('.');
  if (dot == std::string_view::npos || !parse_decimal(head.substr(dot + 1))) return false;
  head = head.substr(0, dot);
  return head.size() >= 8 && head.substr(head.size() - 8) == ".experts";
}

}  // namespace

const char* to_string(LegacyTpSplit split) {
  switch (split) {
    case LegacyTpSplit::Replicated: return "replicated";
    case LegacyTpSplit::Dim0: return "dim 0";
    case LegacyTpSplit::Dim1: return "dim 1";
    case LegacyTpSplit::GateUp: return "gate/up halves";
  }
  return "?";
}

LegacyTpSplit legacy_tp_split(std::string_view name, const std::vector<int64_t>& shard_size, int64_t tp,
                              int64_t moe_ffn) {
  if (tp == 1) return LegacyTpSplit::Replicated;
  const size_t last = name.rfind('.');
  const size_t before = last == std::string_view::npos || last == 0 ? std::string_view::npos : name.rfind('.', last - 1);
  const size_t module_at = before == std::string_view::npos ? 0 : before + 1;
  const std::string_view module = last == std::string_view::npos ? name : name.substr(module_at, last - module_at);
  const std::string_view param = last == std::string_view::npos ? std::string_view{} : name.substr(last + 1);
  const auto rule = std::find_if(kLegacyTpRules.begin(), kLegacyTpRules.end(), [&](const LegacyTpRule& r) {
    return r.module == module && (r.param == "*" || r.param == param);
  });
  if (rule == kLegacyTpRules.end())
    throw Error("legacy Megatron per-rank files: no rule for how '" + std::string(module) + "." + std::string(param) +
                "' is split across " + std::to_string(tp) + " TP ranks")
        .tensor(std::string(name));
  if (module == "output_layer" && !shard_size.empty() && shard_size[0] == 1) return LegacyTpSplit::Replicated;
  if (moe_ffn > 0 && !shard_size.empty() && is_expert_weight(name, name.substr(module_at))) {
    if (rule->split == LegacyTpSplit::GateUp && shard_size[0] == 2 * moe_ffn) return LegacyTpSplit::Replicated;
    if (rule->split == LegacyTpSplit::Dim1 && shard_size.back() == moe_ffn) return LegacyTpSplit::Replicated;
  }
  return rule->split;
}

}  // namespace shardmerge
