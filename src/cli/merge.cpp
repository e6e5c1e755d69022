// `shardmerge plan` (print the MergePlan) and `shardmerge merge` (run it).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "formats/hf_index.hpp"
#include "plan/sharding.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "util/progress.hpp"
#include "util/rss.hpp"
#include "util/trace.hpp"
#include "util/units.hpp"
#include "verify/compare.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void print_plan_human(const PlannedMerge& pm, int verbose) {
  const MergePlan& p = pm.plan;
  std::printf("source: %s\nlayout: %s\n", p.source_dir.c_str(), p.layout.c_str());
  for (const auto& n : p.notes) std::printf("note: %s\n", n.c_str());
  std::printf("output: %zu tensors in %zu files, %s to read, %s to write\n", p.tensors.size(), p.files.size(),
              format_bytes(p.bytes_read()).c_str(), format_bytes(p.bytes_written()).c_str());
  for (const auto& t : p.tensors) {
    std::printf("  %-60s %-9s %-18s %-32s %zu piece(s)  %s\n", t.name.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                shape_string(t.shape).c_str(), (p.files[t.file].name + "@" + std::to_string(t.offset)).c_str(),
                t.copies.size(), t.origin.c_str());
    if (verbose > 0)
      for (const auto& s : t.copies)
        std::printf("      %s @%lu %s strides %s -> start %s\n", p.sources[s.file].path.c_str(),
                    static_cast<unsigned long>(s.offset), shape_string(s.extent).c_str(), shape_string(s.strides).c_str(),
                    shape_string(s.start).c_str());
  }
  for (const auto& s : p.sidecars) std::printf("  + %s\n", s.name.c_str());
}

struct MergeCli {
  MergeCliOptions common;
  ExecCliOptions exec;
};

}  // namespace

void add_exec_options(CLI::App* cmd, ExecCliOptions& o) {
  cmd->add_option("--target_dir,--target-dir", o.target, "Output directory (created atomically)");
  cmd->add_option("--threads", o.threads, "Worker threads (default: two per core)");
  cmd->add_option("--memory-limit,--memory_limit", o.memory_limit, "Peak resident memory, e.g. 512MiB, 2GB");
  add_device_options(cmd, o.device, o.gpu_memory);
  cmd->add_option("--profile", o.profile, "Write a Chrome trace of the phases to this file");
  cmd->add_flag("--json", o.json, "Print the summary as JSON");
  cmd->add_flag("--verify", o.verify, "After writing, re-read the source and compare every output byte");
  cmd->add_flag("--force", o.force, "Replace a non-empty target directory");
}

int write_merge(const std::function<PlannedMerge()>& make_plan, const ExecCliOptions& o) {
  const auto start = Clock::now();
  Trace trace(!o.profile.empty());
  const std::optional<dist::LaunchInfo> launch = dist::launch_from_environment();
  // Under a launcher, `--device cuda` means this process's own GPU, one process per GPU.
  const std::string device = launch && o.device == "cuda" ? "cuda:" + std::to_string(launch->local_rank) : o.device;
  ChosenExecutor chosen = choose_executor(device, o.gpu_memory);
  ExecOptions exec;
  exec.threads = o.threads;
  exec.memory_limit = parse_size(o.memory_limit);
  exec.trace = &trace;
  if (launch) {
    if (!o.profile.empty()) throw usage_error("--profile is not available in a multi-process merge");
    dist::ProcessGroup group(*launch);
    return write_merge_distributed(group, make_plan, o, *chosen.executor, exec);
  }

  PlannedMerge pm;
  {
    auto scope = trace.scope("plan");
    pm = make_plan();
  }
  const MergePlan& plan = pm.plan;
  if (!o.json) {
    std::printf("shardmerge: %s\n  source: %s\n  executor: %s\n", plan.layout.c_str(), pm.role_dir.c_str(),
                chosen.description.c_str());
    for (const auto& n : plan.notes) std::printf("  note: %s\n", n.c_str());
    std::fflush(stdout);
  }

  HfTreeWriter writer(o.target, o.force, pm.role_dir);
  for (const std::string& d : pm.other_source_dirs) writer.refuse_overlap(d);
  writer.create(plan);
  Executor& executor = *chosen.executor;
  Progress progress("merging", plan.bytes_written(), !o.json && Progress::stderr_is_tty());
  exec.progress = &progress;
  const ExecStats stats = executor.run(plan, writer, exec);
  progress.finish();
  {
    auto scope = trace.scope("fsync");
    writer.commit(plan);
  }
  const double secs = seconds_since(start);

  std::optional<TreeDiff> check;
  if (o.verify) {
    // Re-plan against the written tree and compare every byte (reads the source once more).
    auto scope = trace.scope("verify");
    HfWeights written = open_hf_weights(o.target);
    CompareSink sink(plan, written, 0.0);
    ExecOptions again = exec;
    again.progress = nullptr;
    executor.run(plan, sink, again);
    check = sink.result();
  }
  if (!o.profile.empty()) trace.write(o.profile);

  const uint64_t peak = peak_rss_bytes();
  if (o.json) {
    nlohmann::ordered_json j;
    j["source"] = pm.role_dir;
    j["target"] = o.target;
    j["layout"] = plan.layout;
    j["executor"] = chosen.description;
    j["tensors"] = plan.tensors.size();
    j["files"] = plan.files.size();
    j["bytes_read"] = stats.bytes_read;
    j["bytes_written"] = plan.bytes_written();
    j["seconds"] = secs;
    j["gb_per_s"] = secs > 0 ? static_cast<double>(stats.bytes_read + plan.bytes_written()) / secs / 1e9 : 0;
    j["peak_rss_bytes"] = peak;
    j["lora_folds"] = stats.lora_folds;
    j["notes"] = plan.notes;
    if (check) j["verified"] = check->equal();
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("shardmerge: merged %zu tensors into %s: read %s, wrote %s in %.2f s (%s), peak RSS %.1f MiB\n",
                plan.tensors.size(), o.target.c_str(), format_bytes(stats.bytes_read).c_str(),
                format_bytes(plan.bytes_written()).c_str(), secs,
                format_rate(stats.bytes_read + plan.bytes_written(), secs).c_str(), static_cast<double>(peak) / (1 << 20));
    if (check) {
      if (check->equal()) std::printf("shardmerge: verified: every output tensor equals the source bit for bit\n");
      for (const auto& l : check->report(20)) std::printf("  %s\n", l.c_str());
    }
  }
  if (check && !check->equal()) throw Error("verification failed: the written output differs from the source");
  return 0;
}

void add_plan(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("plan", "Print the merge plan: every output tensor and the source byte ranges it is made of");
  auto o = std::make_shared<MergeCliOptions>();
  auto as_json = std::make_shared<bool>(false);
  add_merge_options(cmd, *o);
  cmd->add_flag("--json", *as_json, "Print the MergePlan as JSON");
  cmd->callback([&run, o, as_json] {
    run = [o, as_json] {
      PlannedMerge pm = plan_merge(to_request(*o));
      if (*as_json) std::cout << to_json(pm.plan).dump(2) << "\n";
      else print_plan_human(pm, o->verbose);
      return 0;
    };
  });
}

void add_merge(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("merge", "Merge a checkpoint into a HuggingFace safetensors directory");
  auto o = std::make_shared<MergeCli>();
  add_merge_options(cmd, o->common);
  add_exec_options(cmd, o->exec);
  cmd->callback([&run, o] {
    run = [o] { return write_merge([o] { return plan_merge(to_request(o->common)); }, o->exec); };
  });
}

}  // namespace shardmerge::cli
