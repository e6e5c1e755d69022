// `merge` and `fold-lora`: plan, create the output tree, run the executor, optionally verify,
// commit; one process, or each of several started by a launcher (torchrun, mpirun), found from
// the environment. The result is a MergeSummary, which `merge` prints and shardmerge.merge()
// returns as JSON; the hooks let the caller show progress and stop the run.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>

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

// What a merge did: one type for one process and for several (then `processes` is set and the
// counts are the processes' together).
struct MergeSummary {
  struct Processes {
    int count = 0;
    std::string transport;            // what carries the control messages: "MPI", "TCP bootstrap"
    std::string data_plane;           // what moved slices between processes: "MPI", "NCCL", "none"
    bool node_local_sources = false;  // some rank files are on one node only
    size_t writers = 0;               // processes that wrote output files
    bool target_seen_by_all = false;  // every process saw the temp dir (a shared filesystem)
    uint64_t bytes_sent_between_processes = 0;
  };
  std::string source, target, layout, executor;
  size_t tensors = 0, files = 0;
  uint64_t bytes_read = 0;  // from the sources' disks: each source byte once
  uint64_t bytes_written = 0;
  double seconds = 0, plan_seconds = 0;
  uint64_t peak_rss_bytes = 0;  // several processes: the largest
  double cpu_seconds = 0;       // user + system, of every process together
  uint64_t lora_folds = 0, crc_checked_records = 0;
  unsigned threads = 0;  // per process
  uint64_t peak_read_bytes_in_flight = 0;
  std::vector<std::string> notes, warnings;
  std::optional<Processes> processes;
  std::optional<std::string> verify;  // --verify's one-line verdict (the output verified: a failure throws)

  // The fields the plan and the run's target and executor give; the run adds its counts.
  static MergeSummary of(const PlannedMerge& planned, const std::string& target, const std::string& executor);
  double gb_per_s() const;
  // What `merge --json` prints and shardmerge.merge() returns.
  nlohmann::ordered_json to_json() const;
};

struct MergeOutcome {
  // The summary (none on the processes of a multi-process merge other than rank 0).
  std::optional<MergeSummary> summary;
  PlannedMerge planned;
  std::optional<ReferenceCheck> check;
  double plan_seconds = 0, write_seconds = 0, commit_seconds = 0, verify_seconds = 0;
};

// A plan file (`merge --plan`): its plan is run as made, refused if a source this process reads
// changed since.
struct PlanFile {
  std::string path;
};
// What a merge plans from: a training checkpoint, an HF model with a PEFT adapter (fold-lora), or
// a plan file.
using MergeSource = std::variant<MergeRequest, FoldLoraRequest, PlanFile>;

// Plans (on the calling thread), writes, verifies, commits. `o.target` must be given (the CLI
// fills in verl's default first). In a multi-process merge every process plans the same source;
// a checkpoint's role directory may then be node-local (api/node_local_plan.hpp).
MergeOutcome merge(const MergeSource& source, const WriteOptions& o, const MergeHooks& hooks = {});

}  // namespace shardmerge::api
