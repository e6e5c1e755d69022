// Whether a process id may still belong to the process that made something at a given time:
// pids are reused, so a live pid counts only if that process started no later than the thing
// it is said to have made (a pid from before a reboot or a power loss is reused by then).
#pragma once

#include <ctime>

namespace shardmerge {

// False when no process has this pid, or the one that has it started after `made`. True when
// it cannot be told (no /proc): nothing is removed on a guess.
bool process_may_have_made(int pid, std::time_t made);

}  // namespace shardmerge
