// HuggingFace model directories and PEFT adapter directories as SourceSets: every tensor is
// one contiguous region of a safetensors file (or of a torch.save .bin file).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "layouts/sources.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge::layouts {

// summarise_hf_weights, then combine_hf_weights.
SourceSet describe_hf_weights(const std::string& dir);
// Pure: every tensor where the index puts it.
SourceSet combine_hf_weights(const HfWeightsSummary& summary);

struct AdapterSources {
  SourceSet tensors;
  nlohmann::json config;  // adapter_config.json
  std::string config_path;
};
// summarise_adapter, then combine_adapter.
AdapterSources describe_adapter(const std::string& dir);
// Pure.
AdapterSources combine_adapter(const AdapterSummary& summary);

}  // namespace shardmerge::layouts
