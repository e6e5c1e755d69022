#include "plan/hf_config_check.hpp"

#include <optional>

#include "shardmerge/error.hpp"
#include "util/json_fields.hpp"

namespace shardmerge {
namespace {

std::optional<int64_t> config_int(const nlohmann::ordered_json& config, const char* key) {
  if (config.contains(key) && config[key].is_number_integer()) return config[key].get<int64_t>();
  return std::nullopt;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const NamedShape* find_2d(const std::vector<NamedShape>& tensors, const std::string& suffix) {
  for (const NamedShape& t : tensors)
    if (t.first.ends_with(suffix) && t.second->size() == 2) return &t;
  return nullptr;
}

}  // namespace

void check_config_matches_weights(const nlohmann::ordered_json& full_config, const std::string& config_path,
                                  const std::vector<NamedShape>& tensors, const std::string& weights) {
  const nlohmann::ordered_json& config = hf_text_config(full_config);
  auto require = [&](const char* field, std::optional<int64_t> stated, int64_t implied, const std::string& evidence) {
    if (stated && *stated != implied)
      throw Error(std::string(field) + "=" + std::to_string(*stated) + " disagrees with the weights in " + weights + ": " +
                  evidence + " means " + field + "=" + std::to_string(implied) +
                  "; --hf_model_path must be the config of the model that was trained")
          .file(config_path);
  };
  auto tensor_text = [](const NamedShape& t) { return "'" + t.first + "' " + shape_text(*t.second); };

  // The decoder's tensors share the embedding's prefix ("model.", "model.language_model."): a vision
  // tower's own "layers.N" (multimodal models) are not the decoder's.
  std::string decoder = "model.";
  if (const NamedShape* embed = find_2d(tensors, "embed_tokens.weight")) {
    require("vocab_size", config_int(config, "vocab_size"), (*embed->second)[0], tensor_text(*embed));
    require("hidden_size", config_int(config, "hidden_size"), (*embed->second)[1], tensor_text(*embed));
    decoder = embed->first.substr(0, embed->first.size() - std::string("embed_tokens.weight").size());
  }
  const std::string layers_prefix = decoder + "layers.";

  int64_t layers = 0;
  std::string last_layer_tensor;
  for (const NamedShape& t : tensors) {
    if (t.first.rfind(layers_prefix, 0) != 0) continue;
    const size_t digits_end = t.first.find('.', layers_prefix.size());
    const std::string digits = t.first.substr(layers_prefix.size(), digits_end - layers_prefix.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const int64_t count = std::stoll(digits) + 1;
    if (count > layers) {
      layers = count;
      last_layer_tensor = t.first;
    }
  }
  // Multi-token-prediction layers follow the decoder's (DeepSeek-V3's model.layers.61).
  const int64_t mtp = config_int(config, "num_nextn_predict_layers").value_or(config_int(config, "num_mtp_layers").value_or(0));
  if (layers > 0)
    require("num_hidden_layers", config_int(config, "num_hidden_layers"), layers - mtp,
            "'" + last_layer_tensor + "' (the highest layer index" +
                (mtp ? ", less " + std::to_string(mtp) + " multi-token-prediction layer(s))" : ")"));

  const auto heads = config_int(config, "num_attention_heads");
  const auto hidden = config_int(config, "hidden_size");
  // transformers' rule: head_dim from the config, else hidden_size / num_attention_heads.
  std::optional<int64_t> head_dim = config_int(config, "head_dim");
  if (!head_dim && heads && hidden && *heads > 0 && *hidden % *heads == 0) head_dim = *hidden / *heads;
  if (!head_dim || *head_dim <= 0) return;
  // A projection's rows are (its head count) x head_dim.
  auto check_heads = [&](const char* field, const std::string& suffix) {
    const NamedShape* proj = find_2d(tensors, layers_prefix + "0." + suffix);
    const auto stated = config_int(config, field);
    if (!proj || !stated) return;
    const int64_t rows = (*proj->second)[0];
    if (rows % *head_dim != 0)
      throw Error("head_dim " + std::to_string(*head_dim) + " does not divide the rows of " + tensor_text(*proj) + " in " +
                  weights + "; --hf_model_path must be the config of the model that was trained")
          .file(config_path);
    require(field, stated, rows / *head_dim, tensor_text(*proj) + " with head_dim " + std::to_string(*head_dim));
  };
  // Multi-head latent attention (DeepSeek-V2/V3): a query head is qk_nope + qk_rope rows, and
  // keys and values come from one low-rank projection (no k_proj to count KV heads by).
  const auto nope = config_int(config, "qk_nope_head_dim"), rope = config_int(config, "qk_rope_head_dim");
  if (nope && rope) {
    head_dim = *nope + *rope;
    if (*head_dim <= 0) return;
    check_heads("num_attention_heads", "self_attn.q_proj.weight");
    check_heads("num_attention_heads", "self_attn.q_b_proj.weight");
    return;
  }
  check_heads("num_attention_heads", "self_attn.q_proj.weight");
  check_heads("num_key_value_heads", "self_attn.k_proj.weight");
}

}  // namespace shardmerge
