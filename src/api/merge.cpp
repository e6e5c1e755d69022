#include "api/merge.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "api/distributed_merge.hpp"
#include "api/node_local_plan.hpp"
#include "exec/dist/process_group.hpp"
#include "plan/plan_file.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "shardmerge/trace.hpp"
#include "util/rss.hpp"
#include "util/units.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge::api {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The trace is written after the merge; a path that cannot take it must fail before any work.
// Opening it is the only test that holds for every cause (missing dir, directory, read-only
// filesystem, permissions, root); a file this creates is removed again.
void check_profile_path(const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw usage_error("--profile " + path + ": cannot write there: " + std::strerror(errno));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
}

// What the executor reports as written: tensor data, not headers.
uint64_t tensor_bytes(const MergePlan& plan) {
  uint64_t n = 0;
  for (const auto& t : plan.tensors) n += t.nbytes;
  return n;
}

}  // namespace

MergeSummary MergeSummary::of(const PlannedMerge& planned, const std::string& target, const std::string& executor) {
  MergeSummary s;
  s.source = planned.role_dir;
  s.target = target;
  s.layout = planned.plan.layout;
  s.executor = executor;
  s.tensors = planned.plan.tensors.size();
  s.files = planned.plan.files.size();
  s.bytes_written = planned.plan.bytes_written();
  s.notes = planned.plan.notes;
  s.warnings = planned.plan.warnings;
  return s;
}

double MergeSummary::gb_per_s() const {
  return seconds > 0 ? static_cast<double>(bytes_read + bytes_written) / seconds / 1e9 : 0;
}

nlohmann::ordered_json MergeSummary::to_json() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["target"] = target;
  j["layout"] = layout;
  j["executor"] = executor;
  if (processes) {
    j["processes"] = processes->count;
    j["transport"] = processes->transport;
    j["data_plane"] = processes->data_plane;
    j["node_local_sources"] = processes->node_local_sources;
    j["writers"] = processes->writers;
    j["target_seen_by_all"] = processes->target_seen_by_all;
  }
  j["tensors"] = tensors;
  j["files"] = files;
  j["bytes_read"] = bytes_read;
  if (processes) j["bytes_sent_between_processes"] = processes->bytes_sent_between_processes;
  j["bytes_written"] = bytes_written;
  j["seconds"] = seconds;
  j["plan_seconds"] = plan_seconds;
  j["gb_per_s"] = gb_per_s();
  j["peak_rss_bytes"] = peak_rss_bytes;
  j["cpu_seconds"] = cpu_seconds;
  j["lora_folds"] = lora_folds;
  j["crc_checked_records"] = crc_checked_records;
  j["threads"] = threads;
  j["peak_read_bytes_in_flight"] = peak_read_bytes_in_flight;
  j["notes"] = notes;
  j["warnings"] = warnings;
  if (verify) {
    j["verified"] = true;
    j["verify"] = *verify;
  }
  return j;
}

namespace {

PlannedMerge plan_from_file(const std::string& path) {
  const std::optional<dist::LaunchInfo> launch = dist::launch_from_environment();
  PlannedMerge pm;
  pm.plan = read_plan_file(path);
  confirm_sources_unchanged(pm.plan, path, launch ? launch->rank : -1);
  pm.role_dir = pm.plan.source_dir;
  return pm;
}

PlannedMerge plan_source(const MergeSource& source) {
  struct Plan {
    PlannedMerge operator()(const MergeRequest& r) const { return plan_merge(r); }
    PlannedMerge operator()(const FoldLoraRequest& r) const { return plan_fold_lora(r); }
    PlannedMerge operator()(const PlanFile& f) const { return plan_from_file(f.path); }
  };
  return std::visit(Plan{}, source);
}

}  // namespace

MergeOutcome merge(const MergeSource& source, const WriteOptions& o, const MergeHooks& hooks) {
  const MergeRequest* node_local = std::get_if<MergeRequest>(&source);
  const auto make_plan = [&source] { return plan_source(source); };
  const auto start = Clock::now();
  if (o.target.empty()) throw usage_error("--target_dir is required");
  if (!o.profile.empty()) check_profile_path(o.profile);
  Trace trace(!o.profile.empty());
  if (!(o.peer_timeout > 0)) throw usage_error("--peer-timeout must be a positive number of seconds");
  std::optional<dist::LaunchInfo> launch = o.multi_process ? dist::launch_from_environment() : std::nullopt;
  if (launch) launch->peer_timeout_s = o.peer_timeout;
  // Under a launcher, `--device cuda` means this process's own GPU, one process per GPU.
  const std::string device = launch && o.device == "cuda" ? "cuda:" + std::to_string(launch->local_rank) : o.device;
  parse_device(device);  // a misspelt --device fails before planning
  ExecOptions exec;
  exec.threads = o.threads;
  exec.memory_limit = positive_size("--memory-limit", o.memory_limit);
  exec.check_crc = !o.no_crc;
  exec.trace = &trace;
  exec.cancel = hooks.cancel;
  if (launch) {
    if (!o.profile.empty()) throw usage_error("--profile is not available in a multi-process merge");
    // Each process plans later, inside the group: `auto` weighs the cores only.
    ChosenExecutor chosen = choose_executor(device, o.gpu_memory, Workload{0, 0, o.threads});
    const std::unique_ptr<dist::ProcessGroup> group = dist::join_process_group(*launch);
    return merge_distributed(
        *group,
        [&](dist::ProcessGroup& g) { return node_local ? plan_node_local(g, *node_local) : make_plan(); }, o, hooks,
        *chosen.executor, chosen.description, exec);
  }

  exec.on_written = hooks.on_written;
  MergeOutcome out;
  const auto plan_start = Clock::now();
  {
    auto scope = trace.scope("plan");
    out.planned = make_plan();
  }
  out.plan_seconds = seconds_since(plan_start);
  const PlannedMerge& pm = out.planned;
  const MergePlan& plan = pm.plan;
  ChosenExecutor chosen = choose_executor(device, o.gpu_memory, workload_of(plan, o.threads));
  throw_if_cancelled(hooks.cancel);
  if (hooks.on_start) hooks.on_start(pm, "executor: " + chosen.description, tensor_bytes(plan));

  HfTreeWriter writer(o.target, o.force, pm.role_dir);
  for (const std::string& d : pm.other_source_dirs) writer.refuse_overlap(d);
  writer.create(plan);
  const auto write_start = Clock::now();
  const ExecStats stats = chosen.executor->run(plan, writer, exec);
  if (hooks.on_written_all) hooks.on_written_all();
  out.write_seconds = seconds_since(write_start);

  if (o.verify) {
    // Every element against the checkpoint assembled from its own metadata (reads it again),
    // before the commit: an output that fails verification never appears at the target.
    throw_if_cancelled(hooks.cancel);
    const auto verify_start = Clock::now();
    auto scope = trace.scope("verify");
    out.check = verify_against_sources(pm, writer.temp_dir());
    out.verify_seconds = seconds_since(verify_start);
  }
  if (out.check && !out.check->diff.equal()) {
    if (hooks.on_verify_failed) hooks.on_verify_failed(*out.check);
    throw Error("verification failed: the merged output differs from the source; nothing was written to " + o.target);
  }
  throw_if_cancelled(hooks.cancel);
  const auto commit_start = Clock::now();
  {
    auto scope = trace.scope("fsync");
    writer.commit(plan);
  }
  out.commit_seconds = seconds_since(commit_start);
  if (!o.profile.empty()) trace.write(o.profile);

  MergeSummary& summary = out.summary.emplace(MergeSummary::of(pm, o.target, chosen.description));
  summary.bytes_read = stats.bytes_read;
  summary.seconds = seconds_since(start);
  summary.plan_seconds = out.plan_seconds;
  summary.peak_rss_bytes = peak_rss_bytes();
  summary.cpu_seconds = cpu_seconds();
  summary.lora_folds = stats.lora_folds;
  summary.crc_checked_records = stats.records_checked;
  summary.threads = stats.threads;
  summary.peak_read_bytes_in_flight = stats.peak_read_bytes_in_flight;
  if (out.check) summary.verify = out.check->summary();
  return out;
}

}  // namespace shardmerge::api
