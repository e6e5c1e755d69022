// verl FSDP role directories: model_world_size_W_rank_R.pt files (FSDP1/FSDP2, DTensor,
// ShardedTensor or plain tensors) described as SourceTensors.
#pragma once

#include <vector>

#include "formats/torch_pt.hpp"
#include "layouts/layout.hpp"
#include "layouts/sources.hpp"

namespace shardmerge::layouts {

struct RankFileSummary {
  int64_t rank = 0;
  bool present = false;
  TorchFile file;
};

// Opens every present rank file (pickles only); index = rank.
std::vector<RankFileSummary> read_rank_files(const FsdpRole& role);

// Every tensor of the checkpoint with the rank-file regions that tile it. Replicas are read
// once; a tensor that the present files do not cover exactly once is an error naming it.
SourceSet describe_fsdp(const FsdpRole& role);

}  // namespace shardmerge::layouts
