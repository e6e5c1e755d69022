// api::merge as one of several processes (mpirun, srun, torchrun): every process plans the same
// merge (digest-checked), and rank 0 creates the temp directory beside the target. Where every
// process sees that directory (a shared filesystem), each writes its share of the output files,
// balanced by bytes and by what it would have to fetch; where only rank 0 sees it, rank 0 writes
// everything. A process reads the sources it owns (node-local files) or any shared one; slices
// of sources another process owns come through the transport's data plane, which every process
// serves while the executors run. Rank 0 renames the finished tree into place. Any process
// failing makes every process stop at the next step, and rank 0 removes the temp directory.
#pragma once

#include "api/merge.hpp"
#include "exec/dist/process_group.hpp"
#include "shardmerge/executor.hpp"

namespace shardmerge::api {

MergeOutcome merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge(dist::ProcessGroup&)>& make_plan,
                               const WriteOptions& o, const MergeHooks& hooks, Executor& executor,
                               const std::string& executor_description, const ExecOptions& exec);

}  // namespace shardmerge::api
