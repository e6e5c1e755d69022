// Reading a checkpoint's tensors: summarise each source file (layouts/, the only step that
// touches files, headers and pickles only), then combine the summaries (plan/combine.hpp, pure).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "layouts/layout.hpp"
#include "plan/combine.hpp"

namespace shardmerge {

SourceSet describe_fsdp(const layouts::FsdpRole& role);
// Model tensors of a dist_ckpt: metadata.json's backend checked, then the items of every
// non-training-state chunk summarised.
SourceSet describe_megatron_dist(const std::string& dist_ckpt_dir);
// `config` is the HF config.json. Directory names are checked before any file is opened.
SourceSet describe_megatron_legacy(const layouts::MegatronRole& role, const nlohmann::ordered_json& config);
SourceSet describe_hf_weights(const std::string& dir);
AdapterSources describe_adapter(const std::string& dir);

}  // namespace shardmerge
