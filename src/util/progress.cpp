#include "util/progress.hpp"

#include <unistd.h>

#include <cstdio>

#include "util/units.hpp"

namespace shardmerge {

bool Progress::stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

Progress::Progress(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)), total_(total_bytes), enabled_(enabled), start_(std::chrono::steady_clock::now()) {
  if (!enabled_) return;
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!finished_) {
      wake_.wait_for(lock, std::chrono::milliseconds(200));
      if (!finished_) draw(false);
    }
  });
}

Progress::~Progress() { finish(); }

void Progress::finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) return;
    finished_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (enabled_) draw(true);
}

void Progress::draw(bool final) const {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const uint64_t done = done_.load(std::memory_order_relaxed);
  const double frac = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(frac * kWidth);
  char bar[kWidth + 1];
  for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
  bar[kWidth] = '\0';
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
  const double eta = rate > 0 ? static_cast<double>(total_ - std::min(total_, done)) / rate : 0;
  std::fprintf(stderr, "\r%s [%s] %3.0f%% %s / %s  %s  ETA %.0fs   %s", label_.c_str(), bar, frac * 100,
               format_bytes(done).c_str(), format_bytes(total_).c_str(), format_rate(done, secs).c_str(), eta,
               final ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace shardmerge
