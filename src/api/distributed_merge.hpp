// api::merge as one of several processes (torchrun, mpirun): every process plans the same
// merge, writes its share of the output files into one temp directory on a filesystem they all
// see, and rank 0 renames the finished tree into place. Any process failing makes every process
// stop at the next step, and rank 0 removes the temp directory.
#pragma once

#include "api/merge.hpp"
#include "exec/dist/process_group.hpp"
#include "shardmerge/executor.hpp"

namespace shardmerge::api {

MergeOutcome merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge()>& make_plan,
                               const WriteOptions& o, const MergeHooks& hooks, Executor& executor,
                               const ExecOptions& exec);

}  // namespace shardmerge::api
