#include "verify/reference_model.hpp"

#include <optional>
#include <set>
#include <span>

#include "plan/megatron_names.hpp"
#include "plan/peft_names.hpp"
#include "plan/torchtitan_names.hpp"
#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"
#include "util/shape.hpp"
#include "util/text.hpp"

namespace shardmerge {
namespace {

SourceMap whole(const ReferenceTensor& t) { return {&t, {}, {}, t.shape}; }

int64_t config_int(const nlohmann::ordered_json& c, const char* key, std::optional<int64_t> fallback = std::nullopt) {
  if (c.contains(key) && c[key].is_number_integer()) return c[key].get<int64_t>();
  if (fallback) return *fallback;
  throw Error(std::string("verify: config.json has no integer '") + key + "'");
}

std::string replace_once(std::string s, const std::string& what, const std::string& with) {
  const size_t at = s.find(what);
  if (at != std::string::npos) s.replace(at, what.size(), with);
  return s;
}

// Megatron -> HF, element by element. The fused layouts, as Megatron-Core stores them:
//  - linear_qkv rows: for each of the kv_heads groups, q_per_kv query heads, then one key head,
//    then one value head, head_dim rows each;
//  - linear_fc1 rows: all gate rows, then all up rows.
class MegatronMapper {
 public:
  MegatronMapper(ReferenceModel& model, const nlohmann::ordered_json& config) : model_(model) {
    const std::string arch = config.contains("architectures") && config["architectures"].is_array() &&
                                     !config["architectures"].empty() && config["architectures"][0].is_string()
                                 ? config["architectures"][0].get<std::string>()
                                 : "";
    rules_ = megatron_name_rules(arch);
    if (rules_.empty()) throw Error("verify: no Megatron name table for architecture '" + arch + "'");
    const auto& text = hf_text_config(config);
    heads_ = config_int(text, "num_attention_heads");
    kv_heads_ = config_int(text, "num_key_value_heads", heads_);
    head_dim_ = config_int(text, "head_dim", config_int(text, "hidden_size") / heads_);
    vocab_ = config_int(text, "vocab_size");
    layers_ = config_int(text, "num_hidden_layers");
    language_ = megatron_language_prefix(arch);
    vision_ = megatron_vision_tower(arch);
    if (vision_ && config.contains("vision_config") && config["vision_config"].is_object()) {
      vision_heads_ = config_int(config["vision_config"], "num_heads");
      vision_head_dim_ = config_int(config["vision_config"], "hidden_size") / vision_heads_;
    }
  }

  void run() {
    std::set<int64_t> mtp_layers;
    for (const ReferenceTensor& t : model_.sources.tensors) {
      if (t.name.find("_extra_state") != std::string::npos) continue;
      if (vision_ && t.name.starts_with(vision_->megatron)) {
        vision_key(t);
        continue;
      }
      if (!t.name.starts_with(language_)) continue;  // no HF tensor comes from it
      const std::string name = t.name.substr(language_.size());
      if (const auto layer = mtp_key(t, name)) {
        mtp_layers.insert(*layer);
        continue;
      }
      const std::string prefix = "decoder.layers.";
      if (name.rfind(prefix, 0) != 0) {
        global(t, name);
        continue;
      }
      const std::string rest = name.substr(prefix.size());
      const std::string first = rest.substr(0, rest.find('.'));
      if (const auto layer = parse_decimal(first)) {
        layer_key(t, {}, *layer, rest.substr(first.size() + 1));
        continue;
      }
      // Layer-stacked: source index 0 is the layer.
      for (int64_t l = 0; l < (t.shape.empty() ? 0 : t.shape[0]); ++l) layer_key(t, {l}, l, rest);
    }
    // An MTP layer of the HF checkpoint holds copies of the embedding and the output layer.
    for (const int64_t layer : mtp_layers) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      const auto embedding = model_.weights.find("model.embed_tokens.weight");
      auto head = model_.weights.find("lm_head.weight");
      if (head == model_.weights.end()) head = embedding;
      if (embedding != model_.weights.end()) model_.weights[p + "embed_tokens.weight"] = embedding->second;
      if (head != model_.weights.end()) model_.weights[p + "shared_head.head.weight"] = head->second;
    }
  }

 private:
  // A vision tower's block tensor (per layer or layer-stacked) or one of its other tensors.
  void vision_key(const ReferenceTensor& t) {
    const std::string rest = t.name.substr(vision_->megatron.size()), blocks = "decoder.layers.";
    for (const auto& [megatron, hf] : vision_->globals)
      if (rest == megatron) model_.weights[hf] = whole(t);
    if (!rest.starts_with(blocks)) return;
    const std::string tail = rest.substr(blocks.size());
    const std::string first = tail.substr(0, tail.find('.'));
    auto block = [&](std::vector<int64_t> lead, int64_t l, const std::string& name) {
      for (const auto& r : vision_->rules) {
        if (r.megatron != name) continue;
        SourceMap m{&t, lead, {},
                    std::vector<int64_t>(t.shape.begin() + static_cast<std::ptrdiff_t>(lead.size()), t.shape.end())};
        for (auto& [part, map] : split(r, m))
          model_.weights[replace_once(vision_->hf_blocks + std::to_string(l) + "." + r.hf, "{}", part)] = map;
      }
    };
    if (const auto l = parse_decimal(first); l && first.size() < tail.size())
      return block({}, *l, tail.substr(first.size() + 1));
    for (int64_t l = 0; l < (t.shape.empty() ? 0 : t.shape[0]); ++l) block({l}, l, tail);
  }

  // `mtp.layers.<i>.<rest>`, HF layer num_hidden_layers + i; that layer, or nothing for other keys.
  std::optional<int64_t> mtp_key(const ReferenceTensor& t, const std::string& name) {
    const std::string prefix = "mtp.layers.", block = "transformer_layer.";
    if (name.rfind(prefix, 0) != 0) return std::nullopt;
    const std::string rest = name.substr(prefix.size());
    const std::string first = rest.substr(0, rest.find('.'));
    const auto index = parse_decimal(first);
    if (!index || first.size() == rest.size()) return std::nullopt;
    const int64_t layer = layers_ + *index;
    const std::string inner = rest.substr(first.size() + 1);
    if (inner.rfind(block, 0) == 0)
      layer_key(t, {}, layer, inner.substr(block.size()));
    else
      add(t, {}, layer, -1, "mtp." + inner);
    return layer;
  }

  void global(const ReferenceTensor& t, const std::string& name) {
    auto trimmed = [&](const std::string& hf) {
      SourceMap m = whole(t);
      if (m.shape.size() == 2 && m.shape[0] > vocab_) m.shape[0] = vocab_;  // padded vocab rows are dropped
      model_.weights[hf] = m;
    };
    if (name == "embedding.word_embeddings.weight")
      trimmed("model.embed_tokens.weight");
    else if (name == "decoder.final_layernorm.weight")
      model_.weights["model.norm.weight"] = whole(t);
    // The output layer is lm_head, or a value model's [1, H] head, whichever the plan writes.
    else if (name == "output_layer.weight") {
      trimmed("lm_head.weight");
      model_.weights["score.weight"] = whole(t);
    }
  }

  void layer_key(const ReferenceTensor& t, std::vector<int64_t> lead, int64_t layer, const std::string& rest) {
    const std::string grouped = "mlp.experts.experts.", sequential = "mlp.experts.local_experts.",
                      plain = "mlp.experts.";
    if (rest.rfind(grouped, 0) == 0) {  // grouped GEMM: one more leading [E] index
      const size_t e_dim = lead.size();
      for (int64_t e = 0; e < (t.shape.size() > e_dim ? t.shape[e_dim] : 0); ++e) {
        auto l = lead;
        l.push_back(e);
        add(t, l, layer, e, "mlp.experts.*." + rest.substr(grouped.size()));
      }
      return;
    }
    for (const std::string& p : {sequential, plain}) {
      if (rest.rfind(p, 0) != 0) continue;
      const std::string tail = rest.substr(p.size());
      const std::string id = tail.substr(0, tail.find('.'));
      if (const auto e = parse_decimal(id); e && id.size() < tail.size())
        return add(t, lead, layer, *e, "mlp.experts.*." + tail.substr(id.size() + 1));
    }
    add(t, lead, layer, -1, rest);
  }

  void add(const ReferenceTensor& t, const std::vector<int64_t>& lead, int64_t layer, int64_t expert,
           const std::string& rest) {
    const std::string in = ".adapter.linear_in.weight", out = ".adapter.linear_out.weight";
    const bool is_a = rest.ends_with(in), is_b = rest.ends_with(out);
    const std::string weight = is_a || is_b ? rest.substr(0, rest.size() - (is_a ? in : out).size()) + ".weight" : rest;
    const MegatronNameRule* rule = nullptr;
    for (const auto& r : rules_)
      if (r.megatron == weight) rule = &r;
    if (!rule) return;  // no HF tensor comes from it; an output tensor without a source is reported
    std::string hf = "model.layers." + std::to_string(layer) + "." + rule->hf;
    if (expert >= 0) hf = replace_once(hf, "*", std::to_string(expert));
    SourceMap m{
        &t, lead, {}, std::vector<int64_t>(t.shape.begin() + static_cast<std::ptrdiff_t>(lead.size()), t.shape.end())};
    for (auto& [part, map] : split(*rule, m)) {
      const std::string name = part.empty() ? hf : replace_once(hf, "{}", part);
      const std::string module = name.substr(0, name.size() - std::string(".weight").size());
      if (is_a)
        model_.lora[module].a = m;  // A is shared by the parts of a fused weight
      else if (is_b)
        model_.lora[module].b = map;
      else
        model_.weights[name] = map;
    }
  }

  std::vector<std::pair<std::string, SourceMap>> split(const MegatronNameRule& rule, const SourceMap& m) const {
    auto rows = [&](int64_t n, std::function<int64_t(int64_t)> f) {
      SourceMap out = m;
      out.shape.at(0) = n;
      out.row = std::move(f);
      return out;
    };
    if (rule.split == MegatronNameRule::Split::None) return {{"", m}};
    const auto& part = rule.parts;
    if (rule.split == MegatronNameRule::Split::QkvHeads) {
      // HF row (part p, head i, row j) is Megatron row (3i + p) d + j.
      const int64_t h = vision_heads_, d = vision_head_dim_;
      return {{"", rows(3 * h * d, [=](int64_t r) { return (3 * (r % (h * d) / d) + r / (h * d)) * d + r % d; })}};
    }
    if (rule.split == MegatronNameRule::Split::GateUp) {
      const int64_t half = m.shape.at(0) / 2;
      return {{part.at(0), rows(half, [](int64_t r) { return r; })},
              {part.at(1), rows(half, [half](int64_t r) { return half + r; })}};
    }
    const int64_t q_per_kv = heads_ / kv_heads_, hd = head_dim_;
    const int64_t q_rows = q_per_kv * hd, group = (q_per_kv + 2) * hd;
    return {{part.at(0), rows(kv_heads_ * q_rows, [=](int64_t r) { return r / q_rows * group + r % q_rows; })},
            {part.at(1), rows(kv_heads_ * hd, [=](int64_t r) { return r / hd * group + q_rows + r % hd; })},
            {part.at(2), rows(kv_heads_ * hd, [=](int64_t r) { return r / hd * group + q_rows + hd + r % hd; })}};
  }

  ReferenceModel& model_;
  std::vector<MegatronNameRule> rules_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, vocab_ = 0, layers_ = 0;
  std::string language_;
  std::optional<MegatronVisionTower> vision_;
  int64_t vision_heads_ = 1, vision_head_dim_ = 0;
};

}  // namespace

void map_peft_names(ReferenceModel& model, size_t adapter_begin) {
  // PEFT's name rules need SourceTensors; these carry names, dtypes and shapes only.
  std::vector<SourceTensor> named;
  for (const ReferenceTensor& t : model.sources.tensors) named.push_back({t.name, t.dtype, t.shape, {}, ""});
  PeftSplit split;
  const std::span<const SourceTensor> all(named);
  add_peft_tensors(split, all.first(adapter_begin), /*saved_adapter=*/false);
  add_peft_tensors(split, all.subspan(adapter_begin), /*saved_adapter=*/true);
  auto reference = [&](const SourceTensor* t) -> const ReferenceTensor& {
    return model.sources.tensors.at(static_cast<size_t>(t - named.data()));
  };
  for (const auto& [hf, t] : split.base) model.weights[hf] = whole(reference(t));
  for (const LoraModule& m : split.lora) {
    if (!m.a || !m.b) continue;
    model.lora[m.module] = {whole(reference(m.a)), whole(reference(m.b)), m.embedding};
  }
}

void map_saved_names(ReferenceModel& model, const SavedNameRules& rules) {
  std::map<std::string, SourceMap> saved;
  for (auto& [runtime, map] : model.weights) {
    for (const SavedPart& part : saved_parts(rules, runtime, map.shape)) {
      if (part.drop == 0) {
        saved[part.name] = map;
        continue;
      }
      // Part j of expert e: source element (e, j*R + r, c) is output element (r, c).
      SourceMap m = map;
      m.lead.push_back(part.start[0]);
      const int64_t row0 = part.start[1];
      m.row = [row0](int64_t r) { return row0 + r; };
      m.shape.assign(part.extent.begin() + 1, part.extent.end());
      saved[part.name] = std::move(m);
    }
  }
  model.weights = std::move(saved);
  std::map<std::string, LoraPair> lora = model.lora;
  for (const auto& [module, pair] : model.lora) {
    const std::string weight = saved_parts(rules, module + ".weight", {}).front().name;
    lora.emplace(weight.substr(0, weight.size() - 7), pair);
  }
  model.lora = std::move(lora);
}

void map_megatron_names(ReferenceModel& model, const nlohmann::ordered_json& config) {
  MegatronMapper(model, config).run();
}

void map_torchtitan_names(ReferenceModel& model, const nlohmann::ordered_json& config, const SavedNameRules* rules) {
  using Op = TorchTitanNameRule::Op;
  const nlohmann::ordered_json& text = hf_text_config(config);
  const int64_t heads = text.value("num_attention_heads", int64_t{1});
  const int64_t kv_heads = text.value("num_key_value_heads", heads);
  const bool tied = text.value("tie_word_embeddings", false);
  const std::vector<TorchTitanNameRule> table = torchtitan_name_rules(config);
  for (const ReferenceTensor& t : model.sources.tensors) {
    const auto [layer, rest] = split_torchtitan_name(t.name);
    const std::string prefix = layer ? "model.layers." + std::to_string(*layer) + "." : std::string();
    const TorchTitanNameRule* rule = nullptr;
    for (const auto& r : table)
      if (r.layer == !prefix.empty() && r.titan == rest) rule = &r;
    if (!rule || rule->op == Op::Drop || (tied && rule->hf == "lm_head.weight")) continue;
    const std::string hf = prefix + rule->hf;
    SourceMap m = whole(t);
    if (rule->op == Op::QRows || rule->op == Op::KRows) {
      // HF row o of head h is (half j, pair i): TorchTitan's row 2i + j of that head.
      const int64_t d = t.shape.at(0) / (rule->op == Op::QRows ? heads : kv_heads), half = d / 2;
      m.row = [d, half](int64_t o) { return o / d * d + 2 * (o % d % half) + o % d / half; };
    }
    if (rule->op != Op::Gate && rule->op != Op::Up) {
      model.weights[hf] = std::move(m);
      continue;
    }
    // grouped experts [E, I, H]: part 0 (gate) or 1 (up) of each expert's saved pair
    std::vector<int64_t> fused = t.shape;
    fused.at(1) *= 2;
    const int64_t part = rule->op == Op::Gate ? 0 : 1;
    if (!rules) continue;  // fused output (--keep-runtime-names): not mapped, reported as sourceless
    for (const SavedPart& p : saved_parts(*rules, hf, fused)) {
      if (p.start.at(1) / t.shape.at(1) != part) continue;
      SourceMap e = m;
      e.lead = {p.start.at(0)};
      e.shape.assign(t.shape.begin() + 1, t.shape.end());
      model.weights[p.name] = std::move(e);
    }
  }
}

}  // namespace shardmerge
