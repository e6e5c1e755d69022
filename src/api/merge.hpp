// `merge` and `fold-lora`: plan, create the output tree, run the executor, optionally verify,
// commit; one process, or each of several started by a launcher (torchrun, mpirun), found from
// the environment. The result is the JSON summary that `merge --json` prints and
// shardmerge.merge() returns; the hooks let the caller show progress and stop the run.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "api/options.hpp"
#include "pipeline/planner.hpp"
#include "verify/reference_verify.hpp"

namespace shardmerge::api {

struct MergeHooks {
  // Once the plan is made and the executor chosen, before the output tree is created (on a
  // multi-process merge, on rank 0 only): the plan, a line saying what carries it out, and the
  // tensor bytes on_written reaches when the executor is done (0 on a multi-process merge, which
  // reports no progress).
  std::function<void(const PlannedMerge&, const std::string& runner, uint64_t tensor_bytes)> on_start;
  // Tensor bytes written, called from the executor's threads (single-process merges).
  std::function<void(uint64_t bytes)> on_written;
  // After the executor returns, before verification and the commit (single-process merges).
  std::function<void()> on_written_all;
  // --verify found a difference; merge() throws once this returns.
  std::function<void(const ReferenceCheck&)> on_verify_failed;
  // Set from another thread to stop the merge at the next task boundary (or the next phase):
  // merge() then throws cancelled_error(), leaving neither the target nor a temp directory.
  const std::atomic<bool>* cancel = nullptr;
};

struct MergeOutcome {
  // The summary (null on the processes of a multi-process merge other than rank 0).
  nlohmann::ordered_json summary;
  PlannedMerge planned;
  std::optional<ReferenceCheck> check;
  double plan_seconds = 0, write_seconds = 0, commit_seconds = 0, verify_seconds = 0;
};

// `o.target` must be given (the CLI fills in verl's default first). `node_local`: the request
// `make_plan` plans, for a multi-process merge to plan over node-local role directories instead
// (api/node_local_plan.hpp); without it, every process runs make_plan over what it sees.
MergeOutcome merge(const std::function<PlannedMerge()>& make_plan, const WriteOptions& o, const MergeHooks& hooks = {},
                   const MergeRequest* node_local = nullptr);

// A plan file's plan (`merge --plan`), refused if a source this process reads changed since it
// was made.
PlannedMerge plan_from_file(const std::string& path);

}  // namespace shardmerge::api
