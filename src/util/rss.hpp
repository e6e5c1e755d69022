// Resident memory of this process, as the kernel reports it.
#pragma once

#include <cstdint>

namespace shardmerge {

uint64_t current_rss_bytes();  // VmRSS
uint64_t peak_rss_bytes();     // VmHWM: the high-water mark since start
double cpu_seconds();          // user + system time of all its threads since start

}  // namespace shardmerge
