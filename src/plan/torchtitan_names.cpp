#include "plan/torchtitan_names.hpp"

#include <algorithm>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>

#include "plan/regions.hpp"
#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"
#include "util/shape.hpp"
#include "util/text.hpp"

namespace shardmerge {

namespace {

// How the HF tensor is made of the TorchTitan one.
enum class Op {
  Copy,
  QRows,    // Llama q: per head, TorchTitan's interleaved rotary rows -> HF's halves (n_heads)
  KRows,    // Llama k: the same over n_kv_heads
  Gate,     // grouped experts' w1 [E, I, H]: the first half of dim 1 of the fused gate_up_proj
  Up,       // grouped experts' w3: the second half
  Drop,     // TorchTitan's own state without an HF counterpart (its to_hf leaves it out)
};

// `titan` and `hf` after "layers.<l>." / "model.layers.<l>." for layer rows; whole names for
// the others (layer = false). A table lists a layer's rows in HF's module order.
struct TitanRule {
  std::string_view titan;
  std::string_view hf;
  Op op = Op::Copy;
  bool layer = true;
};

constexpr TitanRule kLlama3[] = {
    {"tok_embeddings.weight", "model.embed_tokens.weight", Op::Copy, false},
    {"norm.weight", "model.norm.weight", Op::Copy, false},
    {"lm_head.weight", "lm_head.weight", Op::Copy, false},  // 0.3
    {"output.weight", "lm_head.weight", Op::Copy, false},   // 0.2
    {"attention.qkv_linear.wq.weight", "self_attn.q_proj.weight", Op::QRows},
    {"attention.qkv_linear.wk.weight", "self_attn.k_proj.weight", Op::KRows},
    {"attention.qkv_linear.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wq.weight", "self_attn.q_proj.weight", Op::QRows},
    {"attention.wk.weight", "self_attn.k_proj.weight", Op::KRows},
    {"attention.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},
    {"feed_forward.w2.weight", "mlp.down_proj.weight"},
    {"attention_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
};

// Qwen3's rotary halves are HF's own: no row reorder.
constexpr TitanRule kQwen3[] = {
    {"tok_embeddings.weight", "model.embed_tokens.weight", Op::Copy, false},
    {"norm.weight", "model.norm.weight", Op::Copy, false},
    {"lm_head.weight", "lm_head.weight", Op::Copy, false},
    {"output.weight", "lm_head.weight", Op::Copy, false},
    {"attention.qkv_linear.wq.weight", "self_attn.q_proj.weight"},
    {"attention.qkv_linear.wk.weight", "self_attn.k_proj.weight"},
    {"attention.qkv_linear.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wq.weight", "self_attn.q_proj.weight"},
    {"attention.wk.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "self_attn.v_proj.weight"},
    {"attention.wo.weight", "self_attn.o_proj.weight"},
    {"attention.q_norm.weight", "self_attn.q_norm.weight"},
    {"attention.k_norm.weight", "self_attn.k_norm.weight"},
    {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w3.weight", "mlp.up_proj.weight"},
    {"feed_forward.w2.weight", "mlp.down_proj.weight"},
    {"moe.router.gate.weight", "mlp.gate.weight"},
    {"moe.routed_experts.inner_experts.w1_EFD", "mlp.experts.gate_up_proj", Op::Gate},
    {"moe.routed_experts.inner_experts.w3_EFD", "mlp.experts.gate_up_proj", Op::Up},
    {"moe.routed_experts.inner_experts.w2_EDF", "mlp.experts.down_proj"},
    {"moe.experts.w1", "mlp.experts.gate_up_proj", Op::Gate},  // 0.2: the same [E, I, H] layouts
    {"moe.experts.w3", "mlp.experts.gate_up_proj", Op::Up},
    {"moe.experts.w2", "mlp.experts.down_proj"},
    {"moe.expert_bias_E", "", Op::Drop},  // its auxiliary-loss-free load balancing bias
    {"moe.expert_bias", "", Op::Drop},
    {"moe.tokens_per_expert", "", Op::Drop},
    {"attention_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
};

struct Family {
  std::string_view model_type;
  std::span<const TitanRule> rules;
};

constexpr Family kFamilies[] = {
    {"llama", kLlama3},
    {"qwen3", kQwen3},
    {"qwen3_moe", kQwen3},
};

int64_t config_int(const nlohmann::ordered_json& config, const char* key) {
  const auto v = json_field<int64_t>(config, key, "config.json", "");
  if (!v || *v <= 0) throw Error(std::string("config.json has no positive ") + key);
  return *v;
}

class Mapper {
 public:
  Mapper(const Family& family, const nlohmann::ordered_json& config) : family_(family) {
    heads_ = config_int(config, "num_attention_heads");
    kv_heads_ = config.contains("num_key_value_heads") && !config["num_key_value_heads"].is_null()
                    ? config_int(config, "num_key_value_heads")
                    : heads_;
    tied_ = config.value("tie_word_embeddings", false);
  }

  HfTensors run(const SourceSet& titan) {
    // HF state-dict order: (embedding / layers / final norm and head, layer, row)
    std::map<std::tuple<int, int64_t, size_t>, SourceTensor> by_key;
    std::map<std::string, std::pair<const SourceTensor*, const SourceTensor*>> gate_up;  // HF name -> (w1, w3)
    std::map<std::string, std::tuple<int, int64_t, size_t>> gate_up_key;
    std::vector<std::string> unknown;
    size_t dropped = 0;
    for (const SourceTensor& t : titan.tensors) {
      const auto [layer, rest] = split_torchtitan_name(t.name);
      const TitanRule* rule = nullptr;
      for (const TitanRule& r : family_.rules)
        if (r.layer == layer.has_value() && r.titan == rest) rule = &r;
      if (!rule) {
        unknown.push_back(t.name);
        continue;
      }
      if (rule->op == Op::Drop) {
        ++dropped;
        continue;
      }
      if (!layer && rule->hf == "lm_head.weight" && tied_) {
        notes_.push_back("tie_word_embeddings: " + t.name + " is the embedding's alias and is not written");
        continue;
      }
      const std::string hf = layer ? "model.layers." + std::to_string(*layer) + "." + std::string(rule->hf) : std::string(rule->hf);
      const int section = !layer ? (rule->hf == "model.embed_tokens.weight" ? 0 : 2) : 1;
      const size_t row = static_cast<size_t>(rule - family_.rules.data());
      const auto key = std::make_tuple(section, layer.value_or(0), row);
      if (rule->op == Op::Gate || rule->op == Op::Up) {
        auto& [gate, up] = gate_up[hf];
        (rule->op == Op::Gate ? gate : up) = &t;
        if (!gate_up_key.count(hf) || key < gate_up_key[hf]) gate_up_key[hf] = key;
        continue;
      }
      by_key.emplace(key, map(t, *rule, hf));
    }
    for (const auto& [hf, pair] : gate_up) {
      const auto& [gate, up] = pair;
      if (!gate || !up)
        throw Error("grouped experts have " + std::string(gate ? "w1 (gate) but no w3 (up)" : "w3 (up) but no w1 (gate)"))
            .tensor((gate ? gate : up)->name);
      by_key.emplace(gate_up_key.at(hf), fuse_gate_up(*gate, *up, hf));
    }
    if (!unknown.empty()) {
      std::string list;
      for (size_t i = 0; i < unknown.size() && i < 8; ++i) list += (i ? ", " : "") + unknown[i];
      throw Error("TorchTitan keys without a rule for model_type " + std::string(family_.model_type) + ": " + list +
                  (unknown.size() > 8 ? ", ... (" + std::to_string(unknown.size()) + " in all)" : std::string()));
    }
    HfTensors out;
    for (auto& [key, t] : by_key) out.tensors.push_back(std::move(t));
    out.notes = std::move(notes_);
    if (dropped)
      out.notes.push_back(std::to_string(dropped) + " TorchTitan tensor(s) without an HF counterpart (MoE load-balancing "
                          "state) are not written, as TorchTitan's own to_hf leaves them out");
    return out;
  }

 private:
  SourceTensor map(const SourceTensor& t, const TitanRule& rule, const std::string& hf) {
    switch (rule.op) {
      case Op::QRows: return rotary_halves(t, hf, heads_);
      case Op::KRows: return rotary_halves(t, hf, kv_heads_);
      case Op::Copy:
      case Op::Gate:
      case Op::Up:
      case Op::Drop: break;
    }
    SourceTensor out = t;
    out.name = hf;
    out.origin = t.origin + ", TorchTitan " + t.name;
    return out;
  }

  // TorchTitan's Llama keeps each head's rotary pairs interleaved (row 2i + j of a head is
  // pair i, half j); HF holds the halves apart (row j * d/2 + i). Every HF row is one row of t.
  SourceTensor rotary_halves(const SourceTensor& t, const std::string& hf, int64_t heads) const {
    if (t.shape.size() != 2 || t.shape[0] % (2 * heads) != 0)
      throw Error("has shape " + shape_string(t.shape) + ": not " + std::to_string(heads) + " heads of an even row count")
          .tensor(t.name);
    const int64_t d = t.shape[0] / heads;
    std::vector<Region> regions;
    regions.reserve(static_cast<size_t>(t.shape[0]));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < 2; ++j)
        for (int64_t i = 0; i < d / 2; ++i)
          regions.push_back(Region{&t, {h * d + 2 * i + j, 0}, {1, t.shape[1]}, {h * d + j * (d / 2) + i, 0}, 0});
    return assemble(hf, t.dtype, t.shape, regions, t.origin + ", TorchTitan " + t.name + " (rotary rows reordered)");
  }

  // transformers' fused [E, 2I, H]: w1 [E, I, H] then w3 along dim 1
  static SourceTensor fuse_gate_up(const SourceTensor& gate, const SourceTensor& up, const std::string& hf) {
    if (gate.shape.size() != 3 || gate.shape != up.shape || gate.dtype != up.dtype)
      throw Error("grouped experts w1 " + shape_string(gate.shape) + " and w3 " + shape_string(up.shape) +
                  " are not two [E, I, H] tensors of one dtype")
          .tensor(gate.name);
    const int64_t e = gate.shape[0], i = gate.shape[1], h = gate.shape[2];
    return assemble(hf, gate.dtype, {e, 2 * i, h},
                    {Region{&gate, {0, 0, 0}, gate.shape, {0, 0, 0}, 0}, Region{&up, {0, 0, 0}, up.shape, {0, i, 0}, 0}},
                    gate.origin + ", TorchTitan " + gate.name + " + " + up.name);
  }

  const Family& family_;
  int64_t heads_ = 0, kv_heads_ = 0;
  bool tied_ = false;
  std::vector<std::string> notes_;
};

const Family& family_of(const nlohmann::ordered_json& text) {
  const std::string model_type = text.value("model_type", std::string());
  for (const Family& f : kFamilies)
    if (f.model_type == model_type) return f;
  std::string known;
  for (const Family& f : kFamilies) known += (known.empty() ? "" : ", ") + std::string(f.model_type);
  throw Error("TorchTitan checkpoint of model_type '" + model_type + "': shardmerge maps " + known + " only");
}

}  // namespace

TorchTitanName split_torchtitan_name(const std::string& name) {
  if (name.starts_with("layers."))
    if (const size_t dot = name.find('.', 7); dot != std::string::npos)
      if (const auto layer = parse_decimal(std::string_view(name).substr(7, dot - 7))) return {layer, name.substr(dot + 1)};
  return {std::nullopt, name};
}

HfTensors map_torchtitan_to_hf(const SourceSet& titan, const nlohmann::ordered_json& config) {
  const nlohmann::ordered_json& text = hf_text_config(config);
  return Mapper(family_of(text), text).run(titan);
}

std::vector<TorchTitanNameRule> torchtitan_name_rules(const nlohmann::ordered_json& config) {
  using Exported = TorchTitanNameRule::Op;
  std::vector<TorchTitanNameRule> out;
  for (const TitanRule& r : family_of(hf_text_config(config)).rules) {
    const Exported op = r.op == Op::QRows ? Exported::QRows
                        : r.op == Op::KRows ? Exported::KRows
                        : r.op == Op::Gate  ? Exported::Gate
                        : r.op == Op::Up    ? Exported::Up
                        : r.op == Op::Drop  ? Exported::Drop
                                            : Exported::Copy;
    out.push_back({op, std::string(r.titan), std::string(r.hf), r.layer});
  }
  return out;
}

}  // namespace shardmerge
