// `shardmerge plan` (print the MergePlan, or write it as a plan file) and `shardmerge merge` (run
// it, made now or read from a plan file).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>

#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "exec/dist/process_group.hpp"
#include "plan/plan_file.hpp"
#include "geometry/sharding.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "util/progress.hpp"
#include "util/rss.hpp"
#include "shardmerge/trace.hpp"
#include "util/units.hpp"
#include "verify/reference_verify.hpp"
#include "write/hf_tree_writer.hpp"

namespace shardmerge::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void print_plan_human(const PlannedMerge& pm, int verbose) {
  const MergePlan& p = pm.plan;
  std::printf("source: %s\nlayout: %s\n", p.source_dir.c_str(), p.layout.c_str());
  for (const auto& n : p.notes) std::printf("note: %s\n", n.c_str());
  for (const auto& w : p.warnings) std::fprintf(stderr, "shardmerge: warning: %s\n", w.c_str());
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
  std::string plan_file;  // --plan: run this plan instead of planning
};

// A plan file's plan, refused if a source this process reads changed since it was made. The
// plan's source_dir is the directory the target must stay out of.
PlannedMerge planned_from_file(const std::string& path) {
  const std::optional<dist::LaunchInfo> launch = dist::launch_from_environment();
  PlannedMerge pm;
  pm.plan = read_plan_file(path);
  confirm_sources_unchanged(pm.plan, path, launch ? launch->rank : -1);
  pm.role_dir = pm.plan.source_dir;
  return pm;
}

// verl's merger writes to ./tmp when --target_dir is not given; shardmerge does too, but says so.
ExecCliOptions with_target(ExecCliOptions o) {
  if (!o.target.empty()) return o;
  o.target = kDefaultTarget;
  std::fprintf(stderr, "shardmerge: warning: no --target_dir given: writing to %s (verl's default)\n",
               std::filesystem::absolute(o.target).lexically_normal().c_str());
  return o;
}

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

// What the executor reports to the progress bar: tensor data, not headers.
uint64_t tensor_bytes(const MergePlan& plan) {
  uint64_t n = 0;
  for (const auto& t : plan.tensors) n += t.nbytes;
  return n;
}

}  // namespace

void add_exec_options(CLI::App* cmd, ExecCliOptions& o) {
  cmd->add_option("--target_dir,--target-dir", o.target,
                  "Output directory (created atomically); when not given, verl's default, said on stderr")
      ->default_str(kDefaultTarget);
  cmd->add_option("--threads", o.threads, "Worker threads; 0: two per core the process may run on");
  cmd->add_option("--memory-limit,--memory_limit", o.memory_limit, "Peak resident memory, e.g. 512MiB, 2GB")
      ->check(byte_size_check());
  add_device_options(cmd, o.device, o.gpu_memory);
  cmd->add_option("--profile", o.profile, "Write a Chrome trace of the phases to this file (default: none)");
  cmd->add_flag("--json", o.json, "Print the summary as JSON");
  cmd->add_flag("--verify", o.verify,
                "After writing, compare every output element with the checkpoint assembled from its own metadata "
                "(independently of the merge plan)");
  cmd->add_flag("--force", o.force, "Replace a non-empty target directory");
  cmd->add_flag("--no-crc,--no_crc", o.no_crc,
                "Do not check the zip CRC-32 of the records read (default: every torch.save record read is checked, "
                "whole; same-dtype copies then go through memory instead of copy_file_range)");
}

int write_merge(const std::function<PlannedMerge()>& make_plan, const ExecCliOptions& given) {
  const auto start = Clock::now();
  if (!given.profile.empty()) check_profile_path(given.profile);
  const ExecCliOptions o = with_target(given);
  Trace trace(!o.profile.empty());
  const std::optional<dist::LaunchInfo> launch = dist::launch_from_environment();
  // Under a launcher, `--device cuda` means this process's own GPU, one process per GPU.
  const std::string device = launch && o.device == "cuda" ? "cuda:" + std::to_string(launch->local_rank) : o.device;
  parse_device(device);  // a misspelt --device fails before planning
  ExecOptions exec;
  exec.threads = o.threads;
  exec.memory_limit = parse_size(o.memory_limit);
  exec.check_crc = !o.no_crc;
  exec.trace = &trace;
  if (launch) {
    if (!o.profile.empty()) throw usage_error("--profile is not available in a multi-process merge");
    // Each process plans later, inside the group: `auto` weighs the cores only.
    ChosenExecutor chosen = choose_executor(device, o.gpu_memory, Workload{0, 0, o.threads});
    dist::ProcessGroup group(*launch);
    return write_merge_distributed(group, make_plan, o, *chosen.executor, exec);
  }

  PlannedMerge pm;
  const auto plan_start = Clock::now();
  {
    auto scope = trace.scope("plan");
    pm = make_plan();
  }
  const double plan_secs = seconds_since(plan_start);
  const MergePlan& plan = pm.plan;
  ChosenExecutor chosen = choose_executor(device, o.gpu_memory, workload_of(plan, o.threads));
  for (const auto& w : plan.warnings) std::fprintf(stderr, "shardmerge: warning: %s\n", w.c_str());
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
  Progress progress("merging", tensor_bytes(plan), !o.json && Progress::stderr_is_tty());
  exec.on_written = [&progress](uint64_t n) { progress.add(n); };
  const auto write_start = Clock::now();
  const ExecStats stats = executor.run(plan, writer, exec);
  progress.finish();
  const double write_secs = seconds_since(write_start);

  std::optional<ReferenceCheck> check;
  const auto verify_start = Clock::now();
  double verify_secs = 0;
  if (o.verify) {
    // Every element against the checkpoint assembled from its own metadata (reads it again),
    // before the commit: an output that fails verification never appears at the target.
    auto scope = trace.scope("verify");
    check = verify_against_sources(pm, writer.temp_dir());
    verify_secs = seconds_since(verify_start);
  }
  if (check && !check->diff.equal()) {
    std::printf("shardmerge: %s\n", check->summary().c_str());
    for (const auto& l : check->diff.report(20)) std::printf("  %s\n", l.c_str());
    throw Error("verification failed: the merged output differs from the source; nothing was written to " + o.target);
  }
  const auto commit_start = Clock::now();
  {
    auto scope = trace.scope("fsync");
    writer.commit(plan);
  }
  const double commit_secs = seconds_since(commit_start);
  const double secs = seconds_since(start);
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
    j["crc_checked_records"] = stats.records_checked;
    j["notes"] = plan.notes;
    j["warnings"] = plan.warnings;
    if (check) {
      j["verified"] = check->diff.equal();
      j["verify"] = check->summary();
    }
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("shardmerge: merged %zu tensors into %s: %s read + %s written in %.2f s (%s read+written), peak RSS "
                "%.1f MiB\n",
                plan.tensors.size(), o.target.c_str(), format_bytes(stats.bytes_read).c_str(),
                format_bytes(plan.bytes_written()).c_str(), secs,
                format_rate(stats.bytes_read + plan.bytes_written(), secs).c_str(), static_cast<double>(peak) / (1 << 20));
    if (o.verbose > 0) {
      std::printf("shardmerge: phases: plan %.3f s, write %.3f s, fsync+rename %.3f s", plan_secs, write_secs, commit_secs);
      if (o.verify) std::printf(", verify %.3f s", verify_secs);
      std::printf("\n");
      for (const auto& t : plan.tensors)
        std::printf("  %-60s %-9s %-18s %s\n", t.name.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                    shape_string(t.shape).c_str(), plan.files[t.file].name.c_str());
    }
    if (check) {
      std::printf("shardmerge: %s\n", check->summary().c_str());
      for (const auto& l : check->diff.report(20)) std::printf("  %s\n", l.c_str());
    }
  }
  return 0;
}

void add_plan(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("plan", "Print the merge plan: every output tensor and the source byte ranges it is made of");
  auto o = std::make_shared<MergeCliOptions>();
  auto as_json = std::make_shared<bool>(false);
  auto out = std::make_shared<std::string>();
  add_merge_options(cmd, *o);
  cmd->add_flag("--json", *as_json, "Print the MergePlan as JSON (the plan file's form)");
  cmd->add_option("--out", *out,
                  "Write the plan file here (atomically), for `shardmerge merge --plan FILE` to run later or elsewhere "
                  "(default: none: print the plan)");
  cmd->callback([&run, o, as_json, out] {
    run = [o, as_json, out] {
      PlannedMerge pm = plan_merge(to_request(*o));
      if (!out->empty()) {
        write_plan_file(*out, pm.plan, planning_options_json(*o));
        for (const auto& w : pm.plan.warnings) std::fprintf(stderr, "shardmerge: warning: %s\n", w.c_str());
        std::fprintf(stderr, "shardmerge: wrote the plan (%zu tensors in %zu files, from %zu source files) to %s\n",
                     pm.plan.tensors.size(), pm.plan.files.size(), pm.plan.sources.size(), out->c_str());
      }
      if (*as_json) std::cout << plan_to_json(pm.plan, planning_options_json(*o)).dump(2) << "\n";
      else if (out->empty()) print_plan_human(pm, o->verbose);
      return 0;
    };
  });
}

void add_merge(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("merge", "Merge a checkpoint into a HuggingFace safetensors directory");
  auto o = std::make_shared<MergeCli>();
  const size_t before = cmd->get_options().size();
  add_merge_options(cmd, o->common);
  // The options that decide the plan (all of add_merge_options but -v): a plan file fixed them.
  std::vector<const CLI::Option*> planning;
  const auto options = cmd->get_options();
  for (size_t i = before; i < options.size(); ++i)
    if (options[i] != cmd->get_option("--verbose")) planning.push_back(options[i]);
  CLI::Option* local_dir = cmd->get_option("--local_dir");
  local_dir->required(false)->description(local_dir->get_description() + " (default: none; required unless --plan)");
  add_exec_options(cmd, o->exec);
  cmd->add_option("--plan", o->plan_file,
                  "Run this plan file (written by `shardmerge plan --out`) as it is, with no re-planning; refused if "
                  "a source file's size or mtime changed since (default: none: plan from --local_dir now)")
      ->check(CLI::ExistingFile);
  cmd->callback([&run, o, planning] {
    if (!o->plan_file.empty()) {
      for (const CLI::Option* opt : planning)
        if (opt->count() > 0)
          throw CLI::ValidationError(opt->get_name(), "cannot be given with --plan: the planning options were fixed "
                                                      "when the plan was made (the plan file lists them)");
    } else if (o->common.local_dir.empty()) {
      throw CLI::RequiredError("--local_dir");
    }
    o->exec.verbose = o->common.verbose;
    run = [o] {
      if (!o->plan_file.empty()) return write_merge([o] { return planned_from_file(o->plan_file); }, o->exec);
      return write_merge([o] { return plan_merge(to_request(o->common)); }, o->exec);
    };
  });
}

}  // namespace shardmerge::cli
