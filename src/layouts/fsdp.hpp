// verl FSDP role directories: the summaries of their model_world_size_W_rank_R.pt files
// (FSDP1/FSDP2, DTensor, ShardedTensor or plain tensors). plan/combine.hpp makes them a SourceSet.
#pragma once

#include <vector>

#include "layouts/layout.hpp"
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

}  // namespace shardmerge::layouts
