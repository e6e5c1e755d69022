#include "util/process_start.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
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

// Seconds since boot at which `pid` started (field 22 of /proc/<pid>/stat), or -1.
long long start_since_boot(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return -1;
  const size_t name_end = line.rfind(')');  // the command name may hold spaces and parentheses
  if (name_end == std::string::npos) return -1;
  std::istringstream fields(line.substr(name_end + 1));
  std::string field;
  for (int i = 3; i < 22; ++i) fields >> field;  // state (3) .. rsslim: skip to starttime
  unsigned long long ticks = 0;
  if (!(fields >> ticks)) return -1;
  const long hz = ::sysconf(_SC_CLK_TCK);
  return hz > 0 ? static_cast<long long>(ticks / static_cast<unsigned long long>(hz)) : -1;
}

}  // namespace

bool process_may_have_made(int pid, std::time_t made) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const long long boot = boot_time(), since_boot = start_since_boot(pid);
  if (boot < 0 || since_boot < 0) return true;
  // One second of slack: btime and the tick count are both rounded.
  return boot + since_boot <= static_cast<long long>(made) + 1;
}

}  // namespace shardmerge
