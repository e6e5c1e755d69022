// verl FSDP role directories: model_world_size_W_rank_R.pt files (FSDP1/FSDP2, DTensor,
// ShardedTensor or plain tensors) described as SourceTensors.
#pragma once

#include <vector>

#include "layouts/layout.hpp"
#include "layouts/sources.hpp"
#include "layouts/summaries.hpp"

namespace shardmerge::layouts {

struct RankFileSummary {
  int64_t rank = 0;
  TorchFileSummary file;
};

// Throws when the role cannot be merged whatever its files hold (no world size, no rank file).
void check_fsdp_role(const FsdpRole& role);

// Summarises every present rank file (pickles only, in parallel), by ascending rank.
std::vector<RankFileSummary> summarise_rank_files(const FsdpRole& role);

// Every tensor of the checkpoint with the rank-file regions that tile it. Replicas are read
// once; a tensor that the present files do not cover exactly once is an error naming it.
// Pure: reads no file.
SourceSet combine_fsdp(const FsdpRole& role, const std::vector<RankFileSummary>& ranks);

// check_fsdp_role, summarise_rank_files, combine_fsdp.
SourceSet describe_fsdp(const FsdpRole& role);

}  // namespace shardmerge::layouts
