// The pure half of reading a checkpoint: per-file summaries (layouts/summaries.hpp) combined
// into the SourceSet the planner works on, every tensor with the source regions that tile it.
// Nothing here opens a file, so a plan can be built from summaries alone (unit tests; summaries
// made elsewhere). pipeline/describe.hpp summarises then combines.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "geometry/source_set.hpp"
#include "layouts/fsdp.hpp"
#include "layouts/layout.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge {

// FSDP rank files. Replicas are read once; a tensor that the present files do not cover
// exactly once is an error naming it (and the missing rank files, if any).
SourceSet combine_fsdp(const layouts::FsdpRole& role, const std::vector<layouts::RankFileSummary>& ranks);

// A torch DCP checkpoint (a Megatron dist_ckpt, a TorchTitan step): the global tensors as stored,
// e.g. Megatron's layer-stacked
// `decoder.layers.self_attention.linear_qkv.weight` [L, rows, H]; chunks are already in global
// coordinates, so this is tiling, not TP arithmetic. Optimizer/scheduler/rng keys are left out.
// A zstd-compressed item becomes a source of its own (SourceFile::compressed) whose decoded
// bytes are its torch.save archive, up to the end of the storage record.
SourceSet combine_dcp(const layouts::DcpSummary& summary);

// Legacy per-rank `model/mp_rank_*/model.pt`: TP shards re-assembled (column-parallel on dim 0,
// row-parallel on dim 1, fc1 as [gate_r; up_r] halves, replicated norms), PP/VPP chunks
// renumbered to global layers, EP-local experts to global ids. Names come out in the per-layer
// form `decoder.layers.<l>.<rest>`, experts `...mlp.experts.<e>.<rest>`. `config` is the HF
// config.json (sizes for experts); `files[i]` is the summary of role.mp_rank_dirs[i]/model.pt.
SourceSet combine_megatron_legacy(const layouts::MegatronRole& role, const nlohmann::ordered_json& config,
                                  const std::vector<layouts::TorchFileSummary>& files);
// Throws when a directory name is not mp_rank_<tp>[_<pp>][_<ep>] or names a rank past the tree.
void check_mp_rank_dirs(const layouts::MegatronRole& role);

// A HuggingFace weights directory: every tensor where the index puts it.
SourceSet combine_hf_weights(const layouts::HfWeightsSummary& summary);

struct AdapterSources {
  SourceSet tensors;
  nlohmann::json config;  // adapter_config.json
  std::string config_path;
};
// A PEFT adapter directory.
AdapterSources combine_adapter(const layouts::AdapterSummary& summary);

}  // namespace shardmerge
