#include "api/plan.hpp"

#include "plan/plan_file.hpp"

namespace shardmerge::api {

PlannedMerge plan(const MergeOptions& o, const std::string& out_file) {
  PlannedMerge pm = plan_merge(to_request(o));
  if (!out_file.empty()) write_plan_file(out_file, pm.plan, planning_options_json(o));
  return pm;
}

nlohmann::ordered_json plan_json(const PlannedMerge& planned, const MergeOptions& o) {
  return plan_to_json(planned.plan, planning_options_json(o));
}

}  // namespace shardmerge::api
