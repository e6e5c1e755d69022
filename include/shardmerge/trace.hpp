// A Chrome trace (chrome://tracing, Perfetto) of what each thread did when: plan, read, cast,
// write, fsync... Disabled traces cost one branch per scope. Public: executors time their phases
// through it (ExecOptions::trace).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace shardmerge {

class Trace {
 public:
  explicit Trace(bool enabled = false);

  class Scope {
   public:
    Scope(Trace* trace, const char* name, uint64_t bytes);
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope();

   private:
    Trace* trace_;
    const char* name_;
    uint64_t bytes_;
    int64_t begin_us_;
  };

  // Times the enclosing block as one event named `name` (a string literal).
  Scope scope(const char* name, uint64_t bytes = 0) { return Scope(enabled_ ? this : nullptr, name, bytes); }
  bool enabled() const { return enabled_; }
  void write(const std::string& path) const;

 private:
  struct Event {
    const char* name;
    int64_t begin_us, duration_us;
    uint64_t bytes;
    uint64_t thread;
  };
  int64_t now_us() const;
  void add(const Event& e);

  bool enabled_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

}  // namespace shardmerge
