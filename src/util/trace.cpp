#include "shardmerge/trace.hpp"

#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "util/file.hpp"

namespace shardmerge {

Trace::Trace(bool enabled) : enabled_(enabled), start_(std::chrono::steady_clock::now()) {}

int64_t Trace::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count();
}

void Trace::add(const Event& e) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(e);
}

Trace::Scope::Scope(Trace* trace, const char* name, uint64_t bytes)
    : trace_(trace), name_(name), bytes_(bytes), begin_us_(trace ? trace->now_us() : 0) {}

Trace::Scope::~Scope() {
  if (!trace_) return;
  const uint64_t tid = std::hash<std::thread::id>{}(std::this_thread::get_id()) % 100000;
  trace_->add({name_, begin_us_, trace_->now_us() - begin_us_, bytes_, tid});
}

void Trace::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : events_) {
    nlohmann::json ev = {{"name", e.name}, {"ph", "X"}, {"ts", e.begin_us}, {"dur", e.duration_us}, {"pid", 1}, {"tid", e.thread}};
    if (e.bytes) ev["args"] = {{"bytes", e.bytes}};
    events.push_back(std::move(ev));
  }
  write_small_file(path, nlohmann::json({{"traceEvents", events}, {"displayTimeUnit", "ms"}}).dump(), /*overwrite=*/true);
}

}  // namespace shardmerge
