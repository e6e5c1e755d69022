// `shardmerge plan` (print the MergePlan, or write it as a plan file) and `shardmerge merge` (run
// it, made now or read from a plan file).
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "api/merge.hpp"
#include "api/plan.hpp"
#include "cli/commands.hpp"
#include "cli/merge_options.hpp"
#include "shardmerge/error.hpp"
#include "util/progress.hpp"
#include "util/shape.hpp"
#include "util/units.hpp"

namespace shardmerge::cli {
namespace {

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

// verl's merger writes to ./tmp when --target_dir is not given; shardmerge does too, but says so.
api::WriteOptions with_target(api::WriteOptions o) {
  if (!o.target.empty()) return o;
  o.target = api::kDefaultTarget;
  std::fprintf(stderr, "shardmerge: warning: no --target_dir given: writing to %s (verl's default)\n",
               std::filesystem::absolute(o.target).lexically_normal().c_str());
  return o;
}

}  // namespace

void add_exec_options(CLI::App* cmd, ExecCliOptions& cli) {
  api::WriteOptions& o = cli.write;
  cmd->add_option("--target_dir,--target-dir", o.target,
                  "Output directory (created atomically); when not given, verl's default, said on stderr. Under "
                  "mpirun/srun/torchrun: where every process sees it (a shared filesystem), each writes its share "
                  "of the output files; where only rank 0 sees it (checked with a token file rank 0 writes), the "
                  "rank 0 writes everything (node-local rank files reach it over NCCL or MPI). The JSON summary's "
                  "\"writers\" says which")
      ->default_str(api::kDefaultTarget);
  cmd->add_option("--transport", o.transport,
                  "What moves slices between processes when rank files are node-local: nccl (the processes' GPUs, "
                  "one each), mpi (host memory; mpirun/srun), auto (nccl where every process has a GPU of its own "
                  "and libnccl loads, else mpi where MPI started the processes)")
      ->check(CLI::IsMember(api::kTransportChoices))
      ->default_str("auto");
  cmd->add_option("--peer-timeout,--peer_timeout", o.peer_timeout,
                  "Seconds a process of a multi-process merge (MPI) waits for a peer that answers nothing (stopped, "
                  "or its network down) before the job fails naming its rank and host; a peer that is busy still "
                  "answers")
      ->check(CLI::PositiveNumber)
      ->default_str("300");
  cmd->add_option("--threads", o.threads, "Worker threads; 0: two per core the process may run on");
  cmd->add_option("--memory-limit,--memory_limit", o.memory_limit, "Peak resident memory, e.g. 512MiB, 2GB")
      ->check(byte_size_check());
  add_device_options(cmd, o.device, o.gpu_memory);
  cmd->add_option("--profile", o.profile, "Write a Chrome trace of the phases to this file (default: none)");
  cmd->add_flag("--json", cli.json, "Print the summary as JSON");
  cmd->add_flag("--verify", o.verify,
                "After writing, compare every output element with the checkpoint assembled from its own metadata "
                "(independently of the merge plan)");
  cmd->add_flag("--force", o.force, "Replace a non-empty target directory");
  cmd->add_flag("--no-crc,--no_crc", o.no_crc,
                "Do not check the zip CRC-32 of the records read (default: every torch.save record read is checked, "
                "whole; same-dtype copies then go through memory instead of copy_file_range)");
}

int write_merge(const api::MergeSource& source, const ExecCliOptions& cli) {
  const api::WriteOptions o = with_target(cli.write);
  std::unique_ptr<Progress> progress;
  api::MergeHooks hooks;
  hooks.on_start = [&](const PlannedMerge& pm, const std::string& runner, uint64_t tensor_bytes) {
    for (const auto& w : pm.plan.warnings) std::fprintf(stderr, "shardmerge: warning: %s\n", w.c_str());
    if (!cli.json) {
      std::printf("shardmerge: %s\n  source: %s\n  %s\n", pm.plan.layout.c_str(), pm.role_dir.c_str(), runner.c_str());
      for (const auto& n : pm.plan.notes) std::printf("  note: %s\n", n.c_str());
      std::fflush(stdout);
    }
    if (tensor_bytes > 0)
      progress = std::make_unique<Progress>("merging", tensor_bytes, !cli.json && Progress::stderr_is_tty());
  };
  hooks.on_written = [&progress](uint64_t n) { progress->add(n); };  // set whenever there are bytes to write
  hooks.on_written_all = [&progress] {
    if (progress) progress->finish();
  };
  hooks.on_verify_failed = [](const ReferenceCheck& check) {
    std::printf("shardmerge: %s\n", check.summary().c_str());
    for (const auto& l : check.diff.report(20)) std::printf("  %s\n", l.c_str());
  };
  const api::MergeOutcome out = api::merge(source, o, hooks);
  if (!out.summary) return 0;  // not rank 0 of a multi-process merge
  const api::MergeSummary& summary = *out.summary;
  if (cli.json) {
    std::cout << summary.to_json().dump(2) << "\n";
    return 0;
  }
  const MergePlan& plan = out.planned.plan;
  const uint64_t read = summary.bytes_read, written = summary.bytes_written;
  const double secs = summary.seconds;
  const double peak_mib = static_cast<double>(summary.peak_rss_bytes) / (1 << 20);
  if (summary.processes)
    std::printf("shardmerge: %d processes merged %zu tensors into %s: %s read + %s written in %.2f s (%s "
                "read+written), largest peak RSS %.1f MiB\n",
                summary.processes->count, summary.tensors, o.target.c_str(), format_bytes(read).c_str(),
                format_bytes(written).c_str(), secs, format_rate(read + written, secs).c_str(), peak_mib);
  else
    std::printf("shardmerge: merged %zu tensors into %s: %s read + %s written in %.2f s (%s read+written), peak RSS "
                "%.1f MiB\n",
                summary.tensors, o.target.c_str(), format_bytes(read).c_str(), format_bytes(written).c_str(), secs,
                format_rate(read + written, secs).c_str(), peak_mib);
  if (cli.verbose > 0 && !summary.processes) {
    std::printf("shardmerge: phases: plan %.3f s, write %.3f s, fsync+rename %.3f s", out.plan_seconds,
                out.write_seconds, out.commit_seconds);
    if (o.verify) std::printf(", verify %.3f s", out.verify_seconds);
    std::printf("\n");
    for (const auto& t : plan.tensors)
      std::printf("  %-60s %-9s %-18s %s\n", t.name.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                  shape_string(t.shape).c_str(), plan.files[t.file].name.c_str());
  }
  if (out.check) {
    std::printf("shardmerge: %s\n", out.check->summary().c_str());
    if (!summary.processes)
      for (const auto& l : out.check->diff.report(20)) std::printf("  %s\n", l.c_str());
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
      const PlannedMerge pm = api::plan(o->plan, *out);
      if (!out->empty()) {
        for (const auto& w : pm.plan.warnings) std::fprintf(stderr, "shardmerge: warning: %s\n", w.c_str());
        std::fprintf(stderr, "shardmerge: wrote the plan (%zu tensors in %zu files, from %zu source files) to %s\n",
                     pm.plan.tensors.size(), pm.plan.files.size(), pm.plan.sources.size(), out->c_str());
      }
      if (*as_json) std::cout << api::plan_json(pm, o->plan).dump(2) << "\n";
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
    } else if (o->common.plan.local_dir.empty()) {
      throw CLI::RequiredError("--local_dir");
    }
    o->exec.verbose = o->common.verbose;
    run = [o] {
      if (!o->plan_file.empty()) return write_merge(api::PlanFile{o->plan_file}, o->exec);
      return write_merge(api::to_request(o->common.plan), o->exec);
    };
  });
}

}  // namespace shardmerge::cli
