// HuggingFace model directories and PEFT adapter directories as SourceSets: every tensor is
// one contiguous region of a safetensors file (or of a torch.save .bin file).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "layouts/sources.hpp"

namespace shardmerge::layouts {

SourceSet describe_hf_weights(const std::string& dir);

struct AdapterSources {
  SourceSet tensors;
  nlohmann::json config;  // adapter_config.json
  std::string config_path;
};
AdapterSources describe_adapter(const std::string& dir);

}  // namespace shardmerge::layouts
