// The multi-process merge of api/distributed_merge.hpp.
#include "api/distributed_merge.hpp"

#include <chrono>
#include <nlohmann/json.hpp>

#include "exec/dist/partition.hpp"
#include "shardmerge/error.hpp"
#include "util/rss.hpp"
#include "verify/reference_verify.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge::api {
namespace {

// Runs `step`, then exchanges its result (or its error) with every process.
template <typename Step>
std::vector<std::string> together(dist::ProcessGroup& group, Step step) {
  std::string out;
  bool ok = true;
  try {
    out = step();
  } catch (const std::exception& e) {
    ok = false;
    out = e.what();
  }
  return group.all_gather(out, ok);
}

}  // namespace

MergeOutcome merge_distributed(dist::ProcessGroup& group, const std::function<PlannedMerge()>& make_plan,
                               const WriteOptions& o, const MergeHooks& hooks, Executor& executor,
                               const ExecOptions& exec) {
  const auto start = std::chrono::steady_clock::now();
  const bool root = group.rank() == 0;
  MergeOutcome out;
  PlannedMerge& pm = out.planned;
  const auto digests = together(group, [&] {
    pm = make_plan();
    return std::to_string(dist::plan_digest(pm.plan));
  });
  for (int r = 1; r < group.size(); ++r)
    if (digests[static_cast<size_t>(r)] != digests[0])
      throw Error("process " + std::to_string(r) + " planned a different merge than rank 0 (do all processes see the same "
                  "checkpoint files?)");
  const MergePlan& plan = pm.plan;
  const dist::RankShare share = dist::share_of(plan, dist::assign_files(plan, group.size()), group.rank());
  if (root && hooks.on_start)
    hooks.on_start(pm, std::to_string(group.size()) + " processes share " + std::to_string(plan.files.size()) +
                           " output files",
                   0);

  HfTreeWriter writer(o.target, o.force, pm.role_dir);
  for (const std::string& d : pm.other_source_dirs) writer.refuse_overlap(d);
  const std::string temp = together(group, [&] {
                             if (root) writer.create(plan, share.owned_files);
                             return writer.temp_dir();
                           }).at(0);
  ExecStats stats;
  const auto all_stats = together(group, [&] {
    if (!root) writer.attach(temp, plan, share.owned_files);
    ExecOptions mine = exec;
    mine.rank = group.rank();  // refuses sources the plan gives to another rank
    stats = executor.run(share.plan, writer, mine);
    writer.sync_files();
    return nlohmann::json{{"read", stats.bytes_read}, {"written", stats.bytes_written}, {"rss", peak_rss_bytes()},
                          {"folds", stats.lora_folds}}
        .dump();
  });
  // --verify: once every process has written and synced its files, the root compares the whole
  // tree, still in the temp dir, with the checkpoint assembled from its own metadata,
  // independently of the plan the processes shared; the others wait for its answer. An output
  // that fails is never committed.
  std::optional<ReferenceCheck>& check = out.check;
  const auto verdict = together(group, [&] {
    if (!root || !o.verify) return std::string();
    check = verify_against_sources(pm, temp);
    return std::string(check->diff.equal() ? "" : "differs");
  });
  if (o.verify && !verdict.at(0).empty()) {
    if (root && hooks.on_verify_failed) hooks.on_verify_failed(*check);
    throw Error("verification failed: the merged output differs from the source; nothing was written to " + o.target);
  }
  together(group, [&] {
    if (root) writer.commit(plan);
    return std::string();
  });
  if (!root) return out;

  uint64_t read = 0, peak = 0, folds = 0;
  for (const auto& s : all_stats) {
    const auto j = nlohmann::json::parse(s);
    read += j["read"].get<uint64_t>();
    peak = std::max<uint64_t>(peak, j["rss"].get<uint64_t>());
    folds += j["folds"].get<uint64_t>();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  nlohmann::ordered_json& j = out.summary;
  j["source"] = pm.role_dir;
  j["target"] = o.target;
  j["processes"] = group.size();
  j["tensors"] = plan.tensors.size();
  j["files"] = plan.files.size();
  j["bytes_read"] = read;
  j["bytes_written"] = plan.bytes_written();
  j["seconds"] = secs;
  j["peak_rss_bytes"] = peak;
  j["lora_folds"] = folds;
  j["notes"] = plan.notes;
  if (check) {
    j["verified"] = true;
    j["verify"] = check->summary();
  }
  return out;
}

}  // namespace shardmerge::api
