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

namespace shardmerge::layouts {

// Model tensors of a dist_ckpt (keys under embedding., decoder., output_layer., and any other
// non-optimizer key, which the name mapping then accepts or refuses). Compressed items are
// decoded into `scratch_dir`.
SourceSet describe_megatron_dist(const std::string& dist_ckpt_dir, const std::string& scratch_dir);

// Keys that hold training state, not weights: a migrated v2 model/dist_ckpt is a hard link of
// the v1 tree and still has them.
bool is_training_state(const std::string& fqn);

// `config` is the HF config.json (sizes for experts and heads).
SourceSet describe_megatron_legacy(const MegatronRole& role, const nlohmann::ordered_json& config);

}  // namespace shardmerge::layouts
