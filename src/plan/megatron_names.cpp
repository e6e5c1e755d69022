#include "plan/megatron_names.hpp"

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "plan/regions.hpp"
#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"
#include "util/shape.hpp"
#include "util/text.hpp"

namespace shardmerge {
namespace {

enum class Split {
  None,
  Qkv,     // [groups x (q_per_kv + 2) x head_dim, ...] -> q, k, v; "{}" in the HF name is q/k/v
  GateUp,  // [gate; up] halves -> gate_proj, up_proj; "{}" is gate/up
  QkvHeads,  // [heads x (q, k, v) x head_dim] (a vision tower, no GQA) -> one tensor [q; k; v]
};

struct Rule {
  const char* megatron;  // per-layer name after "decoder.layers.<l>."; "*" stands for an expert id
  const char* hf;        // after "model.layers.<l>."; "*" is the expert id, "{}" the split part
  Split split = Split::None;
  std::array<const char*, 3> parts = {};  // what "{}" becomes, part by part; empty: q/k/v or gate/up
};

// Rows in HF state-dict order, so output shards follow the order save_pretrained would use.
constexpr Rule kAttention[] = {
    {"self_attention.linear_qkv.weight", "self_attn.{}_proj.weight", Split::Qkv},
    {"self_attention.linear_qkv.bias", "self_attn.{}_proj.bias", Split::Qkv},
    {"self_attention.linear_proj.weight", "self_attn.o_proj.weight"},
};
constexpr Rule kQkNorm[] = {
    {"self_attention.q_layernorm.weight", "self_attn.q_norm.weight"},
    {"self_attention.k_layernorm.weight", "self_attn.k_norm.weight"},
};
// Multi-head latent attention (DeepSeek-V3): low-rank q and kv projections with a norm between
// the down- and the up-projection (fused into the up-projection by Transformer Engine, a module
// of its own in the local spec). Without q_lora_rank, q is one projection.
constexpr Rule kLatentAttention[] = {
    {"self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"},
    {"self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"},
    {"self_attention.linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight"},
    {"self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"},
    {"self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"},
    {"self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    {"self_attention.linear_kv_up_proj.layer_norm_weight", "self_attn.kv_a_layernorm.weight"},
    {"self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"},
    {"self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"},
    {"self_attention.linear_proj.weight", "self_attn.o_proj.weight"},
};
constexpr Rule kDenseMlp[] = {
    {"mlp.linear_fc1.weight", "mlp.{}_proj.weight", Split::GateUp},
    {"mlp.linear_fc2.weight", "mlp.down_proj.weight"},
};
constexpr Rule kRoutedExperts[] = {
    {"mlp.router.weight", "mlp.gate.weight"},
    {"mlp.experts.*.linear_fc1.weight", "mlp.experts.*.{}_proj.weight", Split::GateUp},
    {"mlp.experts.*.linear_fc2.weight", "mlp.experts.*.down_proj.weight"},
};
// Sigmoid routers with a learned per-expert bias on the scores (DeepSeek-V3, GLM4-MoE).
constexpr Rule kExpertBias[] = {
    {"mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"},
};
constexpr Rule kMixtralExperts[] = {
    {"mlp.router.weight", "block_sparse_moe.gate.weight"},
    {"mlp.experts.*.linear_fc1.weight", "block_sparse_moe.experts.*.{}.weight", Split::GateUp, {"w1", "w3"}},
    {"mlp.experts.*.linear_fc2.weight", "block_sparse_moe.experts.*.w2.weight"},
};
constexpr Rule kQwen2SharedExpert[] = {
    {"mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert.{}_proj.weight", Split::GateUp},
    {"mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight"},
    {"mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"},
};
constexpr Rule kDeepseekSharedExperts[] = {
    {"mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.{}_proj.weight", Split::GateUp},
    {"mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"},
};
// Transformer Engine fuses the norms into the next linear; the local spec keeps them apart.
constexpr Rule kNorms[] = {
    {"self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"},
    {"input_layernorm.weight", "input_layernorm.weight"},
    {"mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"},
    {"pre_mlp_layernorm.weight", "post_attention_layernorm.weight"},
};
// A multi-token-prediction layer's own modules (`mtp.layers.<i>.<name>`, written here as
// "mtp.<name>"), saved as layer num_hidden_layers + i of the HF checkpoint; its transformer layer
// (`mtp.layers.<i>.transformer_layer.*`) maps like a decoder layer.
constexpr Rule kMtp[] = {
    {"mtp.enorm.weight", "enorm.weight"},
    {"mtp.hnorm.weight", "hnorm.weight"},
    {"mtp.eh_proj.weight", "eh_proj.weight"},
    {"mtp.final_layernorm.weight", "shared_head.norm.weight"},
};

// Qwen2.5-VL's vision tower (mbridge's vision_model): pre-norm blocks with one fused qkv (which
// Megatron groups per head) and a gated MLP with biases; then the merger's norm and MLP.
constexpr Rule kQwenVisionBlock[] = {
    {"self_attention.linear_qkv.layer_norm_weight", "norm1.weight"},
    {"input_layernorm.weight", "norm1.weight"},
    {"self_attention.linear_qkv.weight", "attn.qkv.weight", Split::QkvHeads},
    {"self_attention.linear_qkv.bias", "attn.qkv.bias", Split::QkvHeads},
    {"self_attention.linear_proj.weight", "attn.proj.weight"},
    {"self_attention.linear_proj.bias", "attn.proj.bias"},
    {"mlp.linear_fc1.layer_norm_weight", "norm2.weight"},
    {"pre_mlp_layernorm.weight", "norm2.weight"},
    {"mlp.linear_fc1.weight", "mlp.{}_proj.weight", Split::GateUp},
    {"mlp.linear_fc1.bias", "mlp.{}_proj.bias", Split::GateUp},
    {"mlp.linear_fc2.weight", "mlp.down_proj.weight"},
    {"mlp.linear_fc2.bias", "mlp.down_proj.bias"},
};

struct Rename {
  const char* megatron;  // after the tower's prefix
  const char* hf;
};
constexpr Rename kQwenVisionGlobals[] = {
    {"patch_embed.proj.weight", "visual.patch_embed.proj.weight"},
    {"decoder.final_layernorm.weight", "visual.merger.ln_q.weight"},
    {"projection.encoder.linear_fc1.weight", "visual.merger.mlp.0.weight"},
    {"projection.encoder.linear_fc1.bias", "visual.merger.mlp.0.bias"},
    {"projection.encoder.linear_fc2.weight", "visual.merger.mlp.2.weight"},
    {"projection.encoder.linear_fc2.bias", "visual.merger.mlp.2.bias"},
};

// A vision tower beside the language model: its blocks' per-layer rules, its other tensors.
struct Tower {
  const char* megatron;   // key prefix, e.g. "vision_model."
  const char* hf_blocks;  // HF prefix of block <l>, e.g. "visual.blocks."
  std::vector<Rule> rules;
  std::vector<Rename> globals;
};

struct Family {
  const char* architecture;
  std::vector<Rule> rules;
  const char* language_prefix = "";  // a multimodal model's language model keys, e.g. "language_model."
  const Tower* vision = nullptr;
};

const Tower kQwen25VisionTower{"vision_model.", "visual.blocks.",
                               {std::begin(kQwenVisionBlock), std::end(kQwenVisionBlock)},
                               {std::begin(kQwenVisionGlobals), std::end(kQwenVisionGlobals)}};

template <size_t... N>
std::vector<Rule> rows(const Rule (&... tables)[N]) {
  std::vector<Rule> out;
  (out.insert(out.end(), std::begin(tables), std::end(tables)), ...);
  return out;
}

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"LlamaForCausalLM", rows(kAttention, kDenseMlp, kNorms)},
      {"MistralForCausalLM", rows(kAttention, kDenseMlp, kNorms)},
      {"Qwen2ForCausalLM", rows(kAttention, kDenseMlp, kNorms)},
      {"Qwen3ForCausalLM", rows(kAttention, kQkNorm, kDenseMlp, kNorms)},
      {"Qwen2MoeForCausalLM", rows(kAttention, kRoutedExperts, kQwen2SharedExpert, kNorms)},
      {"Qwen3MoeForCausalLM", rows(kAttention, kQkNorm, kRoutedExperts, kNorms)},
      {"MixtralForCausalLM", rows(kAttention, kMixtralExperts, kNorms)},
      {"DeepseekV3ForCausalLM",
       rows(kLatentAttention, kDenseMlp, kRoutedExperts, kExpertBias, kDeepseekSharedExperts, kNorms, kMtp)},
      {"Glm4MoeForCausalLM",
       rows(kAttention, kQkNorm, kDenseMlp, kRoutedExperts, kExpertBias, kDeepseekSharedExperts, kNorms, kMtp)},
      {"Qwen2_5_VLForConditionalGeneration", rows(kAttention, kDenseMlp, kNorms), "language_model.",
       &kQwen25VisionTower},
  };
  return f;
}

std::vector<const char*> part_names(const Rule& r) {
  if (r.parts[0]) return {r.parts.begin(), std::find(r.parts.begin(), r.parts.end(), nullptr)};
  switch (r.split) {
    case Split::GateUp: return {"gate", "up"};
    case Split::Qkv: return {"q", "k", "v"};
    case Split::QkvHeads:
    case Split::None: break;
  }
  return {nullptr};
}

constexpr const char* kAdapterIn = ".adapter.linear_in.weight";
constexpr const char* kAdapterOut = ".adapter.linear_out.weight";

int64_t config_int(const nlohmann::ordered_json& c, const char* key, std::optional<int64_t> fallback = std::nullopt) {
  if (c.contains(key) && c[key].is_number_integer()) return c[key].get<int64_t>();
  if (fallback) return *fallback;
  throw Error(std::string("config.json has no integer '") + key + "', needed to convert Megatron tensors");
}

// A per-layer Megatron tensor, after un-stacking.
struct LayerTensor {
  int64_t layer = -1;   // -1 for embedding, final norm, output layer
  int64_t expert = -1;  // routed expert id, or -1
  std::string rest;     // name after "decoder.layers.<l>." ("*" in place of an expert id), or the full name
  SourceTensor tensor;
  bool vision = false;  // a block of the vision tower
};


class Mapper {
 public:
  Mapper(const nlohmann::ordered_json& config, const MegatronMapOptions& options) : options_(options) {
    const std::string arch = config.contains("architectures") && config["architectures"].is_array() &&
                                     !config["architectures"].empty() && config["architectures"][0].is_string()
                                 ? config["architectures"][0].get<std::string>()
                                 : "";
    for (const Family& f : families())
      if (arch == f.architecture) family_ = &f;
    if (!family_) {
      std::string known;
      for (const auto& a : megatron_supported_architectures()) known += (known.empty() ? "" : ", ") + a;
      throw Error("no Megatron -> HF mapping for architecture '" + arch + "' (supported: " + known + ")");
    }
    const nlohmann::ordered_json& text = hf_text_config(config);
    layers_ = config_int(text, "num_hidden_layers");
    // Head counts and sizes are bounded far above any real model, so that the QKV row
    // arithmetic ((heads + 2 x KV heads) x head_dim) cannot overflow.
    constexpr int64_t kMaxHeadsOrDim = int64_t{1} << 20;
    heads_ = config_int(text, "num_attention_heads");
    if (heads_ < 1 || heads_ > kMaxHeadsOrDim)
      throw Error("config.json has num_attention_heads " + std::to_string(heads_) + ", not a head count");
    kv_heads_ = config_int(text, "num_key_value_heads", heads_);
    if (kv_heads_ < 1 || heads_ % kv_heads_ != 0)
      throw Error("config.json's num_key_value_heads " + std::to_string(kv_heads_) + " does not divide num_attention_heads " +
                  std::to_string(heads_));
    head_dim_ = config_int(text, "head_dim", config_int(text, "hidden_size") / heads_);
    if (head_dim_ < 1 || head_dim_ > kMaxHeadsOrDim)
      throw Error("config.json gives a head dimension of " + std::to_string(head_dim_) + ", not a size");
    vocab_ = config_int(text, "vocab_size");
    if (vocab_ < 1) throw Error("config.json has vocab_size " + std::to_string(vocab_) + ", fewer than 1");
    tied_ = options.tie_word_embedding || json_field<bool>(config, "tie_word_embeddings", "config.json").value_or(false) ||
            (&text != &config && json_field<bool>(text, "tie_word_embeddings", "config.json").value_or(false));
    if (family_->vision) {
      if (!config.contains("vision_config") || !config["vision_config"].is_object())
        throw Error("config.json of a " + arch + " has no vision_config, needed to convert its vision tower");
      const nlohmann::ordered_json& vision = config["vision_config"];
      vision_layers_ = config_int(vision, "depth");
      vision_heads_ = config_int(vision, "num_heads");
      if (vision_heads_ < 1 || vision_heads_ > kMaxHeadsOrDim)
        throw Error("config.json's vision_config has num_heads " + std::to_string(vision_heads_) + ", not a head count");
      vision_head_dim_ = config_int(vision, "hidden_size") / vision_heads_;
      if (vision_head_dim_ < 1 || vision_head_dim_ > kMaxHeadsOrDim)
        throw Error("config.json's vision_config gives a head dimension of " + std::to_string(vision_head_dim_));
    }
  }

  HfTensors run(const SourceSet& megatron) {
    const std::string language = family_->language_prefix;
    for (const SourceTensor& t : megatron.tensors) {
      if (t.name.find("_extra_state") != std::string::npos) continue;
      if (family_->vision && t.name.starts_with(family_->vision->megatron)) {
        unstack_vision(t);
      } else if (language.empty()) {
        unstack(t);
      } else if (t.name.starts_with(language)) {
        renamed_.push_back(t);  // the language model's tensors, named as a text model's
        renamed_.back().name = t.name.substr(language.size());
        unstack(renamed_.back());
      } else {
        unknown_.push_back(t.name);
      }
    }
    for (LayerTensor& lt : layer_tensors_) map(lt);
    add_mtp_copies();
    if (!unknown_.empty()) {
      std::string list;
      for (size_t i = 0; i < unknown_.size() && i < 12; ++i) list += (i ? ", " : "") + unknown_[i];
      if (unknown_.size() > 12) list += ", ... (" + std::to_string(unknown_.size()) + " in all)";
      throw Error("Megatron keys with no " + std::string(family_->architecture) + " mapping: " + list +
                  " (extras this architecture's table does not know are not supported)");
    }
    std::stable_sort(out_.tensors.begin(), out_.tensors.end(), [&](const SourceTensor& a, const SourceTensor& b) {
      return sort_key_.at(a.name) < sort_key_.at(b.name);
    });
    return std::move(out_);
  }

 private:
  using Key = std::tuple<int, int64_t, int64_t, size_t, int>;  // section, layer, expert, rule, part

  void unstack(const SourceTensor& t) {
    const std::string prefix = "decoder.layers.";
    if (t.name.find("_extra_state") != std::string::npos) return;
    if (unstack_mtp(t)) return;
    if (t.name.rfind(prefix, 0) != 0) {
      layer_tensors_.push_back({-1, -1, t.name, t});
      return;
    }
    const std::string rest = t.name.substr(prefix.size());
    const size_t dot = rest.find('.');
    if (auto layer = dot == std::string::npos ? std::nullopt : parse_decimal(rest.substr(0, dot))) {
      add_layer_key(*layer, rest.substr(dot + 1), t, 0);  // per-layer key: decoder.layers.<l>.<rest>
      return;
    }
    // Layer-stacked: a leading [L] axis.
    if (t.shape.empty() || t.shape[0] != layers_)
      throw Error("layer-stacked tensor has shape " + shape_string(t.shape) + " but config.json says " +
                  std::to_string(layers_) + " layers")
          .tensor(t.name);
    for (int64_t l = 0; l < layers_; ++l) add_layer_key(l, rest, t, 1, l);
  }

  // A per-layer multi-token-prediction key `mtp.layers.<i>.<rest>`: layer num_hidden_layers + i.
  bool unstack_mtp(const SourceTensor& t) {
    const std::string prefix = "mtp.layers.", block = "transformer_layer.";
    if (t.name.rfind(prefix, 0) != 0) return false;
    const std::string rest = t.name.substr(prefix.size());
    const size_t dot = rest.find('.');
    const auto index = dot == std::string::npos ? std::nullopt : parse_decimal(rest.substr(0, dot));
    if (!index) return false;
    const int64_t layer = layers_ + *index;
    mtp_layers_.insert(layer);
    const std::string inner = rest.substr(dot + 1);
    if (inner.rfind(block, 0) == 0)
      add_layer_key(layer, inner.substr(block.size()), t, 0);
    else
      layer_tensors_.push_back({layer, -1, "mtp." + inner, t});
    return true;
  }

  // An MTP layer of the HF checkpoint holds its own copies of the embedding and the output
  // layer (embed_tokens, shared_head.head), as DeepSeek-V3's and GLM-4.5's checkpoints do.
  void add_mtp_copies() {
    for (const int64_t layer : mtp_layers_) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      const Key key{1, layer, -1, family_->rules.size(), 0};
      if (embedding_) {
        SourceTensor e = *embedding_;
        e.name = p + "embed_tokens.weight";
        emit(std::move(e), key);
      }
      if (const SourceTensor* head = output_ ? &*output_ : tied_ && embedding_ ? &*embedding_ : nullptr) {
        SourceTensor h = *head;
        h.name = p + "shared_head.head.weight";
        emit(std::move(h), {1, layer, -1, family_->rules.size(), 1});
      }
    }
  }

  // `drop` leading dims of `t` are indexed by `lead` (the layer for stacked keys).
  void add_layer_key(int64_t layer, const std::string& rest, const SourceTensor& t, size_t drop, int64_t lead = 0) {
    const std::string grouped = "mlp.experts.experts.";
    const std::string sequential = "mlp.experts.local_experts.";
    std::vector<int64_t> start(t.shape.size(), 0), extent = t.shape;
    if (drop) {
      start[0] = lead;
      extent[0] = 1;
    }
    if (rest.rfind(grouped, 0) == 0) {
      // Grouped-GEMM experts: one more leading [E] axis.
      const size_t e_dim = drop;
      if (t.shape.size() <= e_dim)
        throw Error("grouped experts tensor of shape " + shape_string(t.shape) + " has no experts axis").tensor(t.name);
      for (int64_t e = 0; e < t.shape[e_dim]; ++e) {
        auto s = start, x = extent;
        s[e_dim] = e;
        x[e_dim] = 1;
        push(layer, e, "mlp.experts.*." + rest.substr(grouped.size()), t, s, x, drop + 1);
      }
      return;
    }
    if (rest.rfind(sequential, 0) == 0) {  // SequentialMLP: mlp.experts.local_experts.<e>.<rest>
      const std::string tail = rest.substr(sequential.size());
      const size_t dot = tail.find('.');
      if (auto e = dot == std::string::npos ? std::nullopt : parse_decimal(tail.substr(0, dot))) {
        push(layer, *e, "mlp.experts.*." + tail.substr(dot + 1), t, start, extent, drop);
        return;
      }
    }
    if (rest.rfind("mlp.experts.", 0) == 0) {  // already per expert: mlp.experts.<e>.<rest>
      const std::string tail = rest.substr(12);
      const size_t dot = tail.find('.');
      if (auto e = dot == std::string::npos ? std::nullopt : parse_decimal(tail.substr(0, dot))) {
        push(layer, *e, "mlp.experts.*." + tail.substr(dot + 1), t, start, extent, drop);
        return;
      }
    }
    push(layer, -1, rest, t, start, extent, drop);
  }

  void push(int64_t layer, int64_t expert, const std::string& rest, const SourceTensor& t, std::vector<int64_t> start,
            std::vector<int64_t> extent, size_t drop, bool vision = false) {
    std::vector<int64_t> shape(extent.begin() + static_cast<std::ptrdiff_t>(drop), extent.end());
    std::string name = "decoder.layers." + std::to_string(layer) + "." + rest;
    if (expert >= 0) name.replace(name.find('*'), 1, std::to_string(expert));
    SourceTensor per = drop == 0 ? t
                                 : assemble(name, t.dtype, shape,
                                            {Region{&t, std::move(start), std::move(extent), std::vector<int64_t>(shape.size(), 0), drop}},
                                            t.origin);
    layer_tensors_.push_back({layer, expert, rest, std::move(per), vision});
  }

  // `<tower>decoder.layers.<l>.<rest>` or layer-stacked `<tower>decoder.layers.<rest>`, and the
  // tower's other tensors.
  void unstack_vision(const SourceTensor& t) {
    const Tower& tower = *family_->vision;
    const std::string rest = t.name.substr(std::string(tower.megatron).size()), blocks = "decoder.layers.";
    if (!rest.starts_with(blocks)) {
      for (size_t i = 0; i < tower.globals.size(); ++i) {
        if (rest != tower.globals[i].megatron) continue;
        SourceTensor out = t;
        out.name = tower.globals[i].hf;
        // patch embedding first, then the blocks, then the merger
        return emit(std::move(out), {5, i == 0 ? -1 : std::numeric_limits<int64_t>::max(), 0, i, 0});
      }
      return unknown_.push_back(t.name);
    }
    const std::string tail = rest.substr(blocks.size());
    const size_t dot = tail.find('.');
    if (auto layer = dot == std::string::npos ? std::nullopt : parse_decimal(tail.substr(0, dot)))
      return push(*layer, -1, tail.substr(dot + 1), t, std::vector<int64_t>(t.shape.size(), 0), t.shape, 0, true);
    if (t.shape.empty() || t.shape[0] != vision_layers_)
      throw Error("layer-stacked vision tensor has shape " + shape_string(t.shape) + " but config.json's vision_config says " +
                  std::to_string(vision_layers_) + " blocks")
          .tensor(t.name);
    for (int64_t l = 0; l < vision_layers_; ++l) {
      std::vector<int64_t> start(t.shape.size(), 0), extent = t.shape;
      start[0] = l;
      extent[0] = 1;
      push(l, -1, tail, t, std::move(start), std::move(extent), 1, true);
    }
  }

  void emit(SourceTensor t, Key key) {
    sort_key_[t.name] = key;
    out_.tensors.push_back(std::move(t));
  }

  void map(LayerTensor& lt) {
    const SourceTensor& t = lt.tensor;
    if (lt.vision) return map_vision(lt);
    if (lt.layer < 0) return map_global(t);
    for (const char* adapter : {kAdapterIn, kAdapterOut})
      if (lt.rest.ends_with(adapter)) return map_adapter(lt, adapter == kAdapterIn);
    if (const auto i = rule_for(lt.rest))
      return map_rows(t, family_->rules[*i], hf_name(lt, *i), Key{1, lt.layer, lt.expert, *i, 0});
    unknown_.push_back(t.name);
  }

  void map_vision(const LayerTensor& lt) {
    const Tower& tower = *family_->vision;
    for (size_t i = 0; i < tower.rules.size(); ++i)
      if (lt.rest == tower.rules[i].megatron)
        return map_rows(lt.tensor, tower.rules[i], tower.hf_blocks + std::to_string(lt.layer) + "." + tower.rules[i].hf,
                        Key{5, lt.layer, -1, i, 0});
    unknown_.push_back(lt.tensor.name);
  }

  std::optional<size_t> rule_for(const std::string& rest) const {
    for (size_t i = 0; i < family_->rules.size(); ++i)
      if (rest == family_->rules[i].megatron) return i;
    return std::nullopt;
  }

  std::string hf_name(const LayerTensor& lt, size_t rule) const {
    std::string hf = "model.layers." + std::to_string(lt.layer) + "." + family_->rules[rule].hf;
    if (lt.expert >= 0) hf.replace(hf.find('*'), 1, std::to_string(lt.expert));
    return hf;
  }

  // A tensor whose rows follow the rule's weight (the weight itself, its bias, a LoRA B).
  void map_rows(const SourceTensor& t, const Rule& rule, const std::string& hf, Key key) {
    switch (rule.split) {
      case Split::None: {
        SourceTensor out = t;
        out.name = hf;
        return emit(std::move(out), key);
      }
      case Split::GateUp: return split_gate_up(t, hf, part_names(rule), key);
      case Split::Qkv: return split_qkv(t, hf, part_names(rule), key);
      case Split::QkvHeads: return regroup_qkv_heads(t, hf, key);
    }
  }

  // Megatron-Bridge LoRA (`<module>.adapter.linear_in/out.weight`) as PEFT names of the HF
  // modules: linear_out = B, whose rows split like the fused weight's (QKV per query group,
  // gate/up halves), so that folding each HF part equals folding the fused weight first;
  // linear_in = A, shared by the parts of a fused weight.
  void map_adapter(const LayerTensor& lt, bool is_a) {
    const std::string suffix = is_a ? kAdapterIn : kAdapterOut;
    const auto rule = rule_for(lt.rest.substr(0, lt.rest.size() - suffix.size()) + ".weight");
    if (!rule) return unknown_.push_back(lt.tensor.name);
    std::string hf = hf_name(lt, *rule);
    hf = hf.substr(0, hf.size() - std::string(".weight").size()) + (is_a ? ".lora_A.weight" : ".lora_B.weight");
    const Key key{4, lt.layer, lt.expert, *rule, 0};
    if (!is_a) return map_rows(lt.tensor, family_->rules[*rule], hf, key);
    for (const char* p : part_names(family_->rules[*rule])) {
      SourceTensor a = lt.tensor;
      a.name = p ? part(hf, p) : hf;
      emit(std::move(a), key);
    }
  }

  void map_global(const SourceTensor& t) {
    if (t.name == "embedding.word_embeddings.weight") {
      embedding_ = trim_vocab(t, "model.embed_tokens.weight");
      return emit(*embedding_, {0, 0, 0, 0, 0});
    }
    if (t.name == "decoder.final_layernorm.weight") {
      SourceTensor out = t;
      out.name = "model.norm.weight";
      return emit(std::move(out), {2, 0, 0, 0, 0});
    }
    if (t.name == "output_layer.weight") {
      if (options_.value_model) {
        if (t.shape.size() != 2 || t.shape[0] != 1)
          throw Error("--is-value-model, but the output layer is " + shape_string(t.shape) + ", not a [1, H] value head")
              .tensor(t.name);
        SourceTensor out = t;
        out.name = "score.weight";
        return emit(std::move(out), {3, 0, 0, 0, 0});
      }
      if (t.shape.size() == 2 && t.shape[0] == 1 && vocab_ > 1)
        throw Error("the output layer is a [1, H] value head: pass --is-value-model to write it as score.weight")
            .tensor(t.name);
      if (tied_) {
        out_.notes.push_back("tied embeddings: output_layer.weight is a copy of the embedding and is not written");
        return;
      }
      output_ = trim_vocab(t, "lm_head.weight");
      return emit(*output_, {3, 0, 0, 0, 0});
    }
    unknown_.push_back(t.name);
  }

  SourceTensor trim_vocab(const SourceTensor& t, const std::string& hf) {
    if (t.shape.size() != 2) throw Error("expected a [vocab, hidden] matrix, found " + shape_string(t.shape)).tensor(t.name);
    if (t.shape[0] < vocab_)
      throw Error("has " + std::to_string(t.shape[0]) + " rows but config.json's vocab_size is " + std::to_string(vocab_))
          .tensor(t.name);
    if (t.shape[0] > vocab_)
      out_.notes.push_back(t.name + ": " + std::to_string(t.shape[0] - vocab_) + " padded vocab rows dropped");
    return assemble(hf, t.dtype, {vocab_, t.shape[1]}, {Region{&t, {0, 0}, {vocab_, t.shape[1]}, {0, 0}, 0}}, t.origin);
  }

  // Rows along dim 0; the other dims come whole.
  Region rows_of(const SourceTensor& t, int64_t begin, int64_t count, int64_t dst) {
    std::vector<int64_t> start(t.shape.size(), 0), extent = t.shape, at(t.shape.size(), 0);
    start[0] = begin;
    extent[0] = count;
    at[0] = dst;
    return Region{&t, start, extent, at, 0};
  }

  std::vector<int64_t> with_rows(const SourceTensor& t, int64_t rows) {
    auto s = t.shape;
    s[0] = rows;
    return s;
  }

  static std::string part(const std::string& hf, const char* p) {
    std::string s = hf;
    s.replace(s.find("{}"), 2, p);
    return s;
  }

  void split_gate_up(const SourceTensor& t, const std::string& hf, const std::vector<const char*>& parts, Key key) {
    if (t.shape.empty() || t.shape[0] % 2)
      throw Error("fused gate/up projection has an odd number of rows: " + shape_string(t.shape)).tensor(t.name);
    const int64_t half = t.shape[0] / 2;
    std::get<4>(key) = 0;
    emit(assemble(part(hf, parts.at(0)), t.dtype, with_rows(t, half), {rows_of(t, 0, half, 0)}, t.origin), key);
    std::get<4>(key) = 1;
    emit(assemble(part(hf, parts.at(1)), t.dtype, with_rows(t, half), {rows_of(t, half, half, 0)}, t.origin), key);
  }

  // A vision tower's fused qkv: Megatron's rows are [q_h, k_h, v_h] head by head (one query
  // group per head), HF's one tensor holds every head's q rows, then k, then v.
  void regroup_qkv_heads(const SourceTensor& t, const std::string& hf, Key key) {
    const int64_t h = vision_heads_, d = vision_head_dim_;
    if (t.shape.empty() || t.shape[0] != 3 * h * d)
      throw Error("fused vision qkv has " + (t.shape.empty() ? std::string("no") : std::to_string(t.shape[0])) + " rows; " +
                  std::to_string(h) + " heads of 3 x " + std::to_string(d) + " rows were expected from vision_config")
          .tensor(t.name);
    std::vector<Region> regions;
    for (int64_t part = 0; part < 3; ++part)
      for (int64_t head = 0; head < h; ++head) regions.push_back(rows_of(t, (3 * head + part) * d, d, (part * h + head) * d));
    emit(assemble(hf, t.dtype, t.shape, regions, t.origin), key);
  }

  // Megatron keeps QKV grouped per KV head: [q_1..q_{h/g}, k, v] x groups, head_dim rows each.
  void split_qkv(const SourceTensor& t, const std::string& hf, const std::vector<const char*>& parts, Key key) {
    const int64_t q_per_kv = heads_ / kv_heads_;
    const int64_t group = (q_per_kv + 2) * head_dim_;
    if (t.shape.empty() || t.shape[0] != kv_heads_ * group)
      throw Error("fused QKV has " + (t.shape.empty() ? std::string("no") : std::to_string(t.shape[0])) + " rows; " +
                  std::to_string(kv_heads_) + " KV groups of (" + std::to_string(q_per_kv) + " + 2) x " +
                  std::to_string(head_dim_) + " rows were expected from config.json")
          .tensor(t.name);
    std::vector<Region> q, k, v;
    const int64_t qr = q_per_kv * head_dim_;
    for (int64_t g = 0; g < kv_heads_; ++g) {
      q.push_back(rows_of(t, g * group, qr, g * qr));
      k.push_back(rows_of(t, g * group + qr, head_dim_, g * head_dim_));
      v.push_back(rows_of(t, g * group + qr + head_dim_, head_dim_, g * head_dim_));
    }
    std::get<4>(key) = 0;
    emit(assemble(part(hf, parts.at(0)), t.dtype, with_rows(t, kv_heads_ * qr), q, t.origin), key);
    std::get<4>(key) = 1;
    emit(assemble(part(hf, parts.at(1)), t.dtype, with_rows(t, kv_heads_ * head_dim_), k, t.origin), key);
    std::get<4>(key) = 2;
    emit(assemble(part(hf, parts.at(2)), t.dtype, with_rows(t, kv_heads_ * head_dim_), v, t.origin), key);
  }

  MegatronMapOptions options_;
  const Family* family_ = nullptr;
  int64_t layers_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, vocab_ = 0;
  bool tied_ = false;
  std::vector<LayerTensor> layer_tensors_;
  std::set<int64_t> mtp_layers_;
  int64_t vision_layers_ = 0, vision_heads_ = 0, vision_head_dim_ = 0;
  std::deque<SourceTensor> renamed_;  // language-model tensors under their text-model names (regions point here)
  std::vector<std::string> unknown_;  // keys no row maps, listed in one error
  std::optional<SourceTensor> embedding_, output_;  // as written (vocab rows trimmed), for MTP layers' copies
  HfTensors out_;
  std::map<std::string, Key> sort_key_;
};

}  // namespace

std::vector<std::string> megatron_supported_architectures() {
  std::vector<std::string> out;
  for (const auto& f : families()) out.push_back(f.architecture);
  return out;
}

namespace {

MegatronNameRule exported(const Rule& r) {
  std::vector<std::string> parts;
  for (const char* p : part_names(r))
    if (p) parts.emplace_back(p);
  const auto split = r.split == Split::Qkv        ? MegatronNameRule::Split::Qkv
                     : r.split == Split::GateUp   ? MegatronNameRule::Split::GateUp
                     : r.split == Split::QkvHeads ? MegatronNameRule::Split::QkvHeads
                                                  : MegatronNameRule::Split::None;
  return {split, r.megatron, r.hf, std::move(parts)};
}

const Family* family_of(const std::string& architecture) {
  for (const auto& f : families())
    if (architecture == f.architecture) return &f;
  return nullptr;
}

}  // namespace

std::vector<MegatronNameRule> megatron_name_rules(const std::string& architecture) {
  std::vector<MegatronNameRule> out;
  if (const Family* f = family_of(architecture))
    for (const Rule& r : f->rules) out.push_back(exported(r));
  return out;
}

std::string megatron_language_prefix(const std::string& architecture) {
  const Family* f = family_of(architecture);
  return f ? f->language_prefix : "";
}

std::optional<MegatronVisionTower> megatron_vision_tower(const std::string& architecture) {
  const Family* f = family_of(architecture);
  if (!f || !f->vision) return std::nullopt;
  MegatronVisionTower t{f->vision->megatron, f->vision->hf_blocks, {}, {}};
  for (const Rule& r : f->vision->rules) t.rules.push_back(exported(r));
  for (const Rename& g : f->vision->globals) t.globals.emplace_back(g.megatron, g.hf);
  return t;
}

HfTensors map_megatron_to_hf(const SourceSet& megatron, const nlohmann::ordered_json& config,
                             const MegatronMapOptions& options) {
  Mapper m(config, options);
  return m.run(megatron);
}

}  // namespace shardmerge
