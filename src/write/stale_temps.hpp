// Temp directories that an interrupted run (SIGKILL, power loss) left beside a target:
// `<name>.tmp-<pid>-<n>` (an unfinished output, or after a --force swap the replaced tree) and
// `<name>.tmp-<pid>-<n>.old` (a target moved aside for a swap that did not finish). Call it
// holding the target's lock, so no live run on this host is writing them; a temp directory is
// left alone while its pid belongs to a process that could have made it.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardmerge {

// Removes the stale temp directories of `target` (an absolute, resolved path) and puts back a
// target that was moved aside and never replaced. Returns one note per thing done.
std::vector<std::string> clean_stale_temps(const std::filesystem::path& target);

}  // namespace shardmerge
