// Resharding one tensor along dim 0, as pure arithmetic: which rows of which source rank's
// local tensor land where in each new rank's local tensor. The target is FSDP2's layout: rank f
// of an `fsdp` mesh of size F holds torch.chunk piece f of dim 0, and its storage is padded to
// ceil(dim0 / F) rows (as fully_shard pads). HSDP (ddp, fsdp) targets repeat the fsdp pieces
// on every ddp replica, so a plan for F covers them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "geometry/sharding.hpp"

namespace shardmerge::reshard {

// `rows` rows starting at local row `source_row` of source rank `source` go to local row
// `target_row` of the target rank.
struct RowMove {
  int64_t source = 0;
  int64_t source_row = 0;
  int64_t target_row = 0;
  int64_t rows = 0;
};

struct TargetRows {
  int64_t rows = 0;         // the local tensor's dim 0 (torch.chunk piece)
  int64_t padded_rows = 0;  // its storage's dim 0 (ceil(dim0 / F))
  std::vector<RowMove> moves;  // in target_row order, covering [0, rows) exactly once
};

// `source_runs[r]` is, per tensor dim, the global indices source rank r's local tensor holds
// (dtensor_local_runs). Every dim but 0 must be whole on every rank (otherwise throws Error
// naming `tensor`); rows held by several ranks (replicas) are read from
// one of them, deterministically (the lowest rank holding the first row of a run). Throws
// when a row of [0, global_shape[0]) is held by no rank.
std::vector<TargetRows> plan_row_moves(const std::string& tensor, const std::vector<int64_t>& global_shape,
                                       const std::vector<std::vector<Runs>>& source_runs, int64_t target_fsdp);

}  // namespace shardmerge::reshard
