// `shardmerge prune RUN_ROOT --keep N [--yes]`: removes the global_step_N dirs that
// layouts::plan_prune marks, only with --yes. Removal is crash-safe: each step is renamed into
// RUN_ROOT/.shardmerge-trash (one atomic rename per step, same filesystem), then the trash is
// removed; a trash dir that a killed prune left is removed by the next one, with a note.

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "cli/commands.hpp"
#include "layouts/run_inventory.hpp"
#include "shardmerge/error.hpp"
#include "util/dir_lock.hpp"
#include "util/file.hpp"
#include "util/interrupt.hpp"
#include "util/units.hpp"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace shardmerge::cli {
namespace {

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);  // a symbolic link is removed, never followed
  if (ec) throw Error("cannot remove: " + ec.message()).file(p.string());
}

struct Options {
  std::string run_root;
  int64_t keep = 0;
  bool yes = false;
  bool as_json = false;
};

int prune(const Options& o) {
  const fs::path root(o.run_root);
  const auto listing = layouts::list_run(o.run_root);
  const auto inv = layouts::build_inventory(listing);
  // Decided before anything is touched: a refusal (tracker problems) removes nothing, not
  // even a leftover trash dir.
  const auto decisions = layouts::plan_prune(inv, o.keep);

  uint64_t bytes = 0;
  int count = 0;
  for (const auto& d : decisions)
    if (d.remove) bytes += d.step->bytes, ++count;
  const fs::path trash = root / layouts::kTrashDirName;

  if (o.as_json) {
    json j;
    j["run_root"] = o.run_root;
    j["keep"] = o.keep;
    j["tracker_step"] = *inv.tracker_step;
    j["steps"] = json::array();
    for (const auto& d : decisions)
      j["steps"].push_back({{"name", d.step->name}, {"step", d.step->step}, {"bytes", d.step->bytes},
                            {"action", d.remove ? "remove" : "keep"}, {"reason", d.reason}});
    j["leftover_trash"] = listing.has_trash;
    j["removed"] = o.yes;
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& d : decisions)
      std::printf("%-6s %-22s %12s  %s\n", d.remove ? "remove" : "keep", d.step->name.c_str(),
                  d.step->symlink_target ? "-" : format_bytes(d.step->bytes).c_str(), d.reason.c_str());
  }
  if (!o.yes) {
    if (listing.has_trash)
      std::fprintf(stderr, "note: %s holds what an interrupted prune was removing; --yes removes it first\n",
                   trash.c_str());
    std::fprintf(stderr, "would remove %d step%s (%s); nothing removed: run again with --yes\n", count,
                 count == 1 ? "" : "s", format_bytes(bytes).c_str());
    return 0;
  }

  DirLock lock = DirLock::try_lock((root / ".shardmerge-prune.lock").string());
  if (!lock.locked()) throw Error("another shardmerge prune holds this run root's lock").file(lock.path());
  interrupt::Registration lock_cleanup(lock.path(), interrupt::Removal::File);
  // From here an interrupt removes what is already in the trash; steps not yet moved stay whole.
  interrupt::Registration trash_cleanup(trash.string(), interrupt::Removal::Tree);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(trash, ec))) {
    std::fprintf(stderr, "note: removing %s, left by an interrupted prune\n", trash.c_str());
    remove_tree(trash);
  }
  if (count == 0) {
    std::fprintf(stderr, "nothing to remove\n");
    return 0;
  }
  if (!fs::create_directory(trash, ec) || ec)
    throw Error("cannot create the trash directory: " + (ec ? ec.message() : "it exists")).file(trash.string());
  for (const auto& d : decisions) {
    if (!d.remove) continue;
    const fs::path step = root / d.step->name;
    // Checked again at the last moment: a step replaced by a link since listing is not moved.
    const auto st = fs::symlink_status(step, ec);
    if (ec || !fs::is_directory(st) || fs::is_symlink(st))
      throw Error("no longer a directory; stopped (steps already moved are removed by the next prune)")
          .file(step.string());
    fs::rename(step, trash / d.step->name, ec);
    if (ec) throw Error("cannot move into " + trash.string() + ": " + ec.message()).file(step.string());
  }
  fsync_dir(root);
  remove_tree(trash);
  fsync_dir(root);
  std::fprintf(stderr, "removed %d step%s (%s)\n", count, count == 1 ? "" : "s", format_bytes(bytes).c_str());
  return 0;
}

}  // namespace

void add_prune(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "prune", "Remove old global_step_N checkpoints of a verl run root, keeping the newest N complete ones (only with --yes)");
  auto o = std::make_shared<Options>();
  cmd->add_option("run_root", o->run_root, "verl run root (holds global_step_N/ and latest_checkpointed_iteration.txt)")
      ->required();
  cmd->add_option("--keep", o->keep, "How many of the newest complete steps to keep (at least 1)")->required();
  cmd->add_flag("--yes", o->yes, "Remove the steps; without it, only show what would be removed");
  cmd->add_flag("--json", o->as_json, "Print the decisions as JSON");
  cmd->callback([&run, o] { run = [o] { return prune(*o); }; });
}

}  // namespace shardmerge::cli
