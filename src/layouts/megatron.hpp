// verl Megatron role directories: what summarising them needs beyond layouts/summaries.hpp
// (summarise_dcp, summarise_torch_file). plan/combine.hpp makes the summaries a SourceSet.
#pragma once

#include <string>

#include "formats/dcp.hpp"

namespace shardmerge::layouts {

// A dist_ckpt's metadata.json, when it names a backend, must name torch_dist.
void check_sharded_backend(const std::string& dist_ckpt_dir);

// Keys that hold training state, not weights: a migrated v2 model/dist_ckpt is a hard link of
// the v1 tree and still has them.
bool is_training_state(const std::string& fqn);

// Whether a merge reads the items of dist_ckpt tensor `t`: a model weight stored as the model
// saved it. Training state is left out; so is a weight stored N-D flattened (the distributed
// optimizer's layout), which combine_dcp then refuses by name.
bool merge_reads_items(const DcpMetadata& meta, const DcpTensor& t);

}  // namespace shardmerge::layouts
