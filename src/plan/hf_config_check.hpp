// --hf_model_path: a config.json taken from elsewhere must describe the weights being merged.
// A config from another model size loads into a model of the wrong shape (or, for Megatron,
// splits QKV with the wrong head counts), so the sizes it states are checked against the
// weights' own shapes: vocab and hidden size (embedding), layer count (less multi-token-
// prediction layers), attention and KV heads (query heads of latent attention); a multimodal
// config's nested text_config states the decoder's.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace shardmerge {

// One weight under its HuggingFace name, with its shape.
using NamedShape = std::pair<std::string, const std::vector<int64_t>*>;

// Throws an Error (a data error, as when the checkpoint's own config disagrees) naming the config file, the field, its value, the tensor and the value
// its shape implies (`weights` says where the tensors come from). Fields the config does not
// state, or tensors the model does not have under the usual names, are not checked.
void check_config_matches_weights(const nlohmann::ordered_json& config, const std::string& config_path,
                                  const std::vector<NamedShape>& tensors, const std::string& weights);

}  // namespace shardmerge
