// The steps of a verl run root (`global_step_N/` beside `latest_checkpointed_iteration.txt`):
// which roles each holds, whether each is complete, and which steps `prune --keep N` removes.
// `list_run` walks the filesystem into a RunListing (names, sizes, the .distcp files each DCP
// `.metadata` names); `build_inventory` and `plan_prune` only interpret that listing, so unit
// tests build listings by hand.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "layouts/layout.hpp"

namespace shardmerge::layouts {

// The .distcp files a DCP `.metadata` names (its tensor chunks' relative paths).
struct DcpRefs {
  std::string dir;  // relative to the role dir, e.g. "model/dist_ckpt"
  std::vector<std::string> files;
  std::string error;  // why `.metadata` could not be read; empty when it was
};

struct RoleListing {
  std::string name;  // "actor", "critic", ...; "." when the step dir is itself the role dir (SFT)
  std::variant<FsdpRole, MegatronRole, AutomodelRole, TorchTitanCheckpoint> info;  // as detect() reads it
  std::vector<std::string> files;  // regular files under the role dir, relative to it ('/'-separated)
  std::vector<DcpRefs> dcp;        // one per `.metadata` under the role dir
};

struct StepListing {
  int64_t step = 0;
  std::string name;  // "global_step_N"
  std::optional<std::string> symlink_target;  // set when the step dir is a symbolic link (never walked)
  std::vector<RoleListing> roles;
  std::vector<std::string> temp_entries;  // "*.tmp-*" / "*.tmp" entries under the step (relative)
  uint64_t bytes = 0;                      // sum of the regular files' sizes (symlinks not followed)
};

struct RunListing {
  std::string path;
  std::vector<StepListing> steps;
  std::optional<std::string> tracker_text;  // latest_checkpointed_iteration.txt; nullopt when absent
  std::vector<std::string> stray_temps;     // run-level "*.tmp-*" entries (not steps; never removed)
  bool has_trash = false;                   // a `.shardmerge-trash` left by an interrupted prune
};

inline constexpr const char* kTrashDirName = ".shardmerge-trash";

struct RoleStatus {
  std::string name;
  std::string kind;  // "fsdp" or "megatron"
  std::vector<std::string> problems;  // empty when complete
};

struct StepStatus {
  int64_t step = 0;
  std::string name;
  std::optional<std::string> symlink_target;
  uint64_t bytes = 0;
  std::vector<RoleStatus> roles;
  std::vector<std::string> problems;  // the step's own and its roles' (prefixed "actor: ")
  bool tracked = false;                // the step the tracker names
  bool complete() const { return problems.empty() && !symlink_target; }
};

struct RunInventory {
  std::string path;
  std::vector<StepStatus> steps;  // ascending by step
  std::optional<int64_t> tracker_step;
  std::string tracker_problem;  // why the tracker cannot be used (missing, unparsable, names no step)
  std::vector<std::string> stray_temps;
  bool has_trash = false;
};

RunInventory build_inventory(const RunListing& listing);

struct PruneDecision {
  const StepStatus* step = nullptr;
  bool remove = false;
  std::string reason;
};

// One decision per step, ascending. Protected, whatever `keep` says: the tracker's step, every
// newer step, and symlinked steps. Kept: the `keep` newest complete steps at or below the
// tracker's. Removed: every other step older than the oldest of those (complete or not); with
// fewer than `keep` complete steps nothing is removed. Throws a data Error (exit 1) when the
// tracker is missing, unparsable or names a missing step, a usage Error when keep < 1.
std::vector<PruneDecision> plan_prune(const RunInventory& inventory, int64_t keep);

// Walks RUN_ROOT. Throws a usage Error when it does not exist or is not a directory.
RunListing list_run(const std::string& run_root);

}  // namespace shardmerge::layouts
