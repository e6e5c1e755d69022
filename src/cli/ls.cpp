// `shardmerge ls RUN_ROOT [--json]`: every global_step_N of a verl run, its roles, size,
// whether it is complete, and which one latest_checkpointed_iteration.txt names.
#include <cstdio>
#include <iostream>

#include "cli/commands.hpp"
#include "layouts/run_inventory.hpp"
#include "util/units.hpp"

using json = nlohmann::ordered_json;

namespace shardmerge::cli {
namespace {

json to_json(const layouts::RunInventory& inv) {
  json j;
  j["run_root"] = inv.path;
  j["tracker_step"] = inv.tracker_step ? json(*inv.tracker_step) : json(nullptr);
  j["tracker_problem"] = inv.tracker_problem;
  j["steps"] = json::array();
  for (const auto& s : inv.steps) {
    json js;
    js["step"] = s.step;
    js["name"] = s.name;
    js["symlink_target"] = s.symlink_target ? json(*s.symlink_target) : json(nullptr);
    js["bytes"] = s.bytes;
    js["complete"] = s.complete();
    js["tracker"] = s.tracked;
    js["roles"] = json::array();
    for (const auto& r : s.roles)
      js["roles"].push_back({{"name", r.name}, {"kind", r.kind}, {"complete", r.problems.empty()}, {"problems", r.problems}});
    js["problems"] = s.problems;
    j["steps"].push_back(std::move(js));
  }
  j["stray_temps"] = inv.stray_temps;
  j["interrupted_prune"] = inv.has_trash;
  return j;
}

void print_table(const layouts::RunInventory& inv) {
  std::printf("run root: %s\n", inv.path.c_str());
  if (inv.tracker_problem.empty()) std::printf("tracker: step %lld\n", static_cast<long long>(*inv.tracker_step));
  else std::printf("tracker: %s\n", inv.tracker_problem.c_str());
  std::printf("%-22s %-9s %12s  %-24s %s\n", "STEP", "COMPLETE", "SIZE", "ROLES", "NOTES");
  for (const auto& s : inv.steps) {
    std::string roles;
    for (const auto& r : s.roles) roles += (roles.empty() ? "" : ",") + r.name + "(" + r.kind + ")";
    std::string notes = s.tracked ? "tracker" : "";
    for (const auto& p : s.problems) notes += (notes.empty() ? "" : "; ") + p;
    std::printf("%-22s %-9s %12s  %-24s %s\n", s.name.c_str(), s.complete() ? "yes" : "no",
                s.symlink_target ? "-" : format_bytes(s.bytes).c_str(), roles.empty() ? "-" : roles.c_str(),
                notes.c_str());
  }
  for (const auto& t : inv.stray_temps) std::printf("note: %s: temporary entry left by a killed writer (not a step)\n", t.c_str());
  if (inv.has_trash)
    std::printf("note: %s: left by an interrupted prune; `shardmerge prune` removes it\n", layouts::kTrashDirName);
}

}  // namespace

void add_ls(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("ls", "List the global_step_N checkpoints of a verl run root: roles, size, completeness, tracker");
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("run_root", *path, "verl run root (holds global_step_N/ and latest_checkpointed_iteration.txt)")->required();
  cmd->add_flag("--json", *as_json, "Print the inventory as JSON");
  cmd->callback([&run, path, as_json] {
    run = [path, as_json] {
      const auto inv = layouts::build_inventory(layouts::list_run(*path));
      if (*as_json) std::cout << to_json(inv).dump(2) << "\n";
      else print_table(inv);
      return 0;
    };
  });
}

}  // namespace shardmerge::cli
