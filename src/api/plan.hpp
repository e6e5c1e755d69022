// `plan`: the MergePlan of a checkpoint, optionally written as a plan file for `merge --plan`;
// its JSON form (the plan file's) is what `plan --json` prints and shardmerge.plan() returns.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "api/options.hpp"
#include "pipeline/planner.hpp"

namespace shardmerge::api {

// With `out_file`, also writes the plan file there (atomically).
PlannedMerge plan(const MergeOptions& o, const std::string& out_file = "");
nlohmann::ordered_json plan_json(const PlannedMerge& planned, const MergeOptions& o);

}  // namespace shardmerge::api
