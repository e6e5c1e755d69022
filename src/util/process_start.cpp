#include "util/process_start.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace shardmerge {
namespace {

// Seconds since the epoch at which the system booted ("btime" of /proc/stat), or -1.
long long boot_time() {
  std::ifstream in("/proc/stat");
  std::string key;
  long long value = 0;
  while (in >> key) {
    if (key == "btime" && in >> value) return value;
    in.ignore(1 << 20, '\n');
  }
  return -1;
}

struct ProcStat {
  char state = '?';        // field 3: R, S, D, Z (ended, not yet reaped), X ...
  long long start = -1;    // field 22, in seconds since boot; -1 when unknown
};

// /proc/<pid>/stat's state and start time; nullopt when there is no such file.
std::optional<ProcStat> proc_stat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  ProcStat out;
  const size_t name_end = line.rfind(')');  // the command name may hold spaces and parentheses
  if (name_end == std::string::npos) return out;
  std::istringstream fields(line.substr(name_end + 1));
  std::string field;
  fields >> out.state;
  for (int i = 4; i < 22; ++i) fields >> field;  // ppid (4) .. rsslim: skip to starttime
  unsigned long long ticks = 0;
  const long hz = ::sysconf(_SC_CLK_TCK);
  if (fields >> ticks && hz > 0) out.start = static_cast<long long>(ticks / static_cast<unsigned long long>(hz));
  return out;
}

}  // namespace

bool process_may_have_made(int pid, std::time_t made) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const auto stat = proc_stat(pid);
  // A zombie has ended and writes nothing more; it keeps its pid until its parent (or init)
  // reaps it, which a launcher that SIGKILLed it and exited leaves to init.
  if (stat && (stat->state == 'Z' || stat->state == 'X')) return false;
  const long long boot = boot_time(), since_boot = stat ? stat->start : -1;
  if (boot < 0 || since_boot < 0) return true;
  // One second of slack: btime and the tick count are both rounded.
  return boot + since_boot <= static_cast<long long>(made) + 1;
}

}  // namespace shardmerge
