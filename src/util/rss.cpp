#include "util/rss.hpp"

#include <cstdio>
#include <cstring>

#include <sys/resource.h>

namespace shardmerge {
namespace {

uint64_t status_kib(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  uint64_t kib = 0;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      std::sscanf(line + n + 1, "%lu", &kib);
      break;
    }
  std::fclose(f);
  return kib;
}

}  // namespace

uint64_t current_rss_bytes() { return status_kib("VmRSS") * 1024; }
uint64_t peak_rss_bytes() { return status_kib("VmHWM") * 1024; }

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

}  // namespace shardmerge
