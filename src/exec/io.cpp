#include "exec/io.hpp"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace shardmerge {

unsigned usable_cores() {
  cpu_set_t set;
  unsigned cores = 0;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cores = static_cast<unsigned>(CPU_COUNT(&set));
  if (cores == 0) cores = std::thread::hardware_concurrency();
  return std::max(1u, cores);
}

unsigned default_io_threads() { return 2 * usable_cores(); }

}  // namespace shardmerge
