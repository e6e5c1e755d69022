#include "exec/io.hpp"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace shardmerge {

unsigned default_io_threads() {
  cpu_set_t set;
  unsigned cores = 0;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) cores = static_cast<unsigned>(CPU_COUNT(&set));
  if (cores == 0) cores = std::thread::hardware_concurrency();
  return 2 * std::max(1u, cores);
}

}  // namespace shardmerge
