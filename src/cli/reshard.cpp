// `shardmerge reshard --local_dir ROLE_DIR --world_size W2 --target_dir OUT [--mesh ddp=A,fsdp=B]`:
// a verl FSDP checkpoint rewritten for another world size, to resume training there.
#include <cstdio>
#include <memory>

#include "api/options.hpp"
#include "cli/commands.hpp"
#include "reshard/reshard.hpp"
#include "util/units.hpp"

namespace shardmerge::cli {

void add_reshard(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "reshard", "Rewrite a verl FSDP checkpoint (model, optimizer, extra state) for another world size, to resume there");
  auto o = std::make_shared<reshard::ReshardOptions>();
  auto no_crc = std::make_shared<bool>(false);
  auto memory_limit = std::make_shared<std::string>("512MiB");
  cmd->add_option("--local_dir,--local-dir", o->local_dir, "verl FSDP role dir (global_step_N/actor), a step root or a run root")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--world_size,--world-size", o->world_size, "Number of ranks of the job that will load the output")
      ->required()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--target_dir,--target-dir", o->target_dir, "Output role directory (written atomically)")->required();
  cmd->add_option("--mesh", o->mesh, "HSDP target: ddp=A,fsdp=B (A*B = world size); default: a 1-D fsdp mesh");
  cmd->add_flag("--force", o->force, "Replace a non-empty target directory");
  cmd->add_flag("--no-crc", *no_crc, "Skip the zip CRC-32 check of the bytes read");
  cmd->add_option("--memory-limit,--memory_limit", *memory_limit,
                  "Resident memory the process may use (it streams through an 8 MiB buffer; the pickles it holds "
                  "grow with the model)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Target ranks written at once (default: one per core)")->check(CLI::Range(1u, 1024u));
  cmd->callback([&run, o, no_crc, memory_limit] {
    run = [o, no_crc, memory_limit] {
      o->check_crc = !*no_crc;
      o->memory_limit = api::positive_size("--memory-limit", *memory_limit);
      const reshard::ReshardSummary s = reshard::reshard_role(*o);
      for (const std::string& n : s.notes) std::fprintf(stderr, "shardmerge: note: %s\n", n.c_str());
      std::string mesh;
      for (int64_t d : s.target_mesh) mesh += (mesh.empty() ? "" : "x") + std::to_string(d);
      std::printf("resharded %s: world size %lld -> %lld (mesh %s), %d files, %s%s%s -> %s; peak RSS %s\n",
                  s.role_dir.c_str(), static_cast<long long>(s.source_world), static_cast<long long>(s.target_world),
                  mesh.c_str(), s.files_written, format_bytes(s.bytes_written).c_str(),
                  s.optimizer ? ", optimizer state" : "", s.extra_state ? ", extra state" : "", o->target_dir.c_str(),
                  format_bytes(s.peak_rss_bytes).c_str());
      return 0;
    };
  });
}

}  // namespace shardmerge::cli
