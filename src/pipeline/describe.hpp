// Reading a checkpoint's tensors: summarise each source file (layouts/, the only step that
// touches files, headers and pickles only), then combine the summaries (plan/combine.hpp, pure).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "layouts/layout.hpp"
#include "layouts/node_local.hpp"
#include "plan/combine.hpp"

namespace shardmerge {

// `gathered` (a node-local multi-process merge): the rank files' summaries come from the
// processes that hold them, and the role is a NodeLocalView's.
SourceSet describe_fsdp(const layouts::FsdpRole& role, const layouts::GatheredSummaries* gathered = nullptr);
// Model tensors of a torch DCP checkpoint (a Megatron dist_ckpt, a TorchTitan step): Megatron's metadata.json backend checked, then the items of every
// non-training-state chunk summarised (or taken from `gathered`, refusing a chunk whose file no
// process holds).
SourceSet describe_dcp(const std::string& dist_ckpt_dir, const layouts::GatheredSummaries* gathered = nullptr);
// `config` is the HF config.json. Directory names are checked before any file is opened.
SourceSet describe_megatron_legacy(const layouts::MegatronRole& role, const nlohmann::ordered_json& config);
SourceSet describe_hf_weights(const std::string& dir);
AdapterSources describe_adapter(const std::string& dir);

}  // namespace shardmerge
