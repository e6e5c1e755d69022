// verl Megatron role directories as SourceSets.
//  - dist_ckpt (torch_dist / DCP): the global tensors as stored, e.g. the layer-stacked
//    `decoder.layers.self_attention.linear_qkv.weight` [L, rows, H]; chunks are already in
//    global coordinates, so this is tiling, not TP arithmetic.
//  - legacy per-rank `model/mp_rank_*/model.pt`: TP shards re-assembled (column-parallel on
//    dim 0, row-parallel on dim 1, fc1 as [gate_r; up_r] halves, replicated norms), PP/VPP
//    chunks renumbered to global layers, EP-local experts to global ids. Names come out in
//    the per-layer form `decoder.layers.<l>.<rest>`, experts `...mlp.experts.<e>.<rest>`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "layouts/layout.hpp"
#include "layouts/sources.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge::layouts {

// Model tensors of a dist_ckpt (keys under embedding., decoder., output_layer., and any other
// non-optimizer key, which the name mapping then accepts or refuses): metadata.json's backend
// checked, then summarise_dcp, then combine_megatron_dist.
SourceSet describe_megatron_dist(const std::string& dist_ckpt_dir);
// Pure. A zstd-compressed item becomes a source of its own (SourceFile::compressed) whose
// decoded bytes are its torch.save archive, up to the end of the storage record; planning
// decoded only the archive's head (summarise_dcp).
SourceSet combine_megatron_dist(const DcpSummary& summary);

// Keys that hold training state, not weights: a migrated v2 model/dist_ckpt is a hard link of
// the v1 tree and still has them.
bool is_training_state(const std::string& fqn);

// `config` is the HF config.json (sizes for experts and heads). Summarises every
// mp_rank_*/model.pt, then combine_megatron_legacy.
SourceSet describe_megatron_legacy(const MegatronRole& role, const nlohmann::ordered_json& config);
// Pure. `files[i]` is the summary of role.mp_rank_dirs[i]/model.pt.
SourceSet combine_megatron_legacy(const MegatronRole& role, const nlohmann::ordered_json& config,
                                  const std::vector<TorchFileSummary>& files);

}  // namespace shardmerge::layouts
