// Planning a merge whose role directory is spread over the nodes of a multi-process merge
// (layouts/node_local.hpp), as collective steps every process runs together:
//   1. rank 0 resolves the role dir (a run or step root is followed there) and tells the others;
//   2. each process lists its files under that path; all listings are exchanged (small files
//      with their bytes);
//   3. each builds the same view, summarises the data files it is the lowest holder of, and the
//      summaries are exchanged;
//   4. each plans over the view with the gathered summaries; the plan names the real paths,
//      each source owned by the process that reads it, sidecars carried as content.
// Over a shared filesystem every file is everyone's (kAnyOwner) and the plan is what one
// process would make.
#pragma once

#include "exec/dist/process_group.hpp"
#include "pipeline/planner.hpp"

namespace shardmerge::api {

PlannedMerge plan_node_local(dist::ProcessGroup& group, const MergeRequest& request);

// True when some source is owned by one process (read elsewhere through the data plane).
bool has_node_local_sources(const MergePlan& plan);

}  // namespace shardmerge::api
