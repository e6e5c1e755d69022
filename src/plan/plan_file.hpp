// The plan file: a MergePlan as JSON, lossless, so that a plan made in one place (a login node:
// planning reads headers only) can be reviewed and then run elsewhere (`merge --plan`) exactly
// as made, with no re-planning. `plan --json` prints the same form.
//
// Reading is strict, as for checkpoint files: a missing or unknown version, a missing field, a
// field of the wrong type or out of range, an unknown field, a duplicate key, a derived field
// (a copy's `length`, a cast op, `bytes_read`, ...) that disagrees with the fields it comes
// from, or geometry that does not hold (a piece outside its tensor or its source file, pieces
// that do not tile a tensor exactly once, a tensor outside its output file) is refused with
// one error naming the plan file and the field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "shardmerge/plan.hpp"

namespace shardmerge {

// The value of the top-level "shardmerge_plan" field this build writes and reads.
inline constexpr int kPlanFileVersion = 1;

// `options`: the planning options, kept in the file for a reviewer (never read back).
nlohmann::ordered_json plan_to_json(const MergePlan& plan, const nlohmann::ordered_json& options);
// The plan `json` holds; `plan_file` names it in errors.
MergePlan plan_from_json(const nlohmann::ordered_json& json, const std::string& plan_file);
// The same from the file's text (which must be one JSON object with no key given twice).
MergePlan parse_plan_file(const std::string& text, const std::string& plan_file);

// Writes the plan file atomically (a temp file beside it, fsynced, then renamed over `path`).
void write_plan_file(const std::string& path, const MergePlan& plan, const nlohmann::ordered_json& options);
MergePlan read_plan_file(const std::string& path);

// Refuses (naming the file) a source that is missing, or whose size or mtime differs from the
// plan's stamp, or for which the plan records none. Only size and mtime are compared: on
// another machine or over a copied tree the same file has another inode, device and ctime.
// Each source checked then gets its stamp of now, which the executor compares exactly while it
// runs. `rank`: this process's rank in a multi-process merge (-1: a single process), which
// checks only the sources it can read (owned by any process or by it).
void confirm_sources_unchanged(MergePlan& plan, const std::string& plan_file, int32_t rank);

}  // namespace shardmerge
