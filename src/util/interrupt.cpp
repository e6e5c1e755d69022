#include "util/interrupt.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>
#include <vector>

namespace shardmerge::interrupt {
namespace {

struct Entry {
  unsigned long id;
  std::string path;
  Removal how;
};

// One registry for the process. Never destroyed: the interrupt thread may use it while main
// returns and static destructors run.
struct Registry {
  std::recursive_mutex mutex;
  std::vector<Entry> entries;
  unsigned long next_id = 1;
};

Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

sigset_t handled_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  return set;
}

// Whether something was there to remove.
bool remove_entry(const Entry& e) {
  std::error_code ec;
  switch (e.how) {
    case Removal::Tree: return std::filesystem::remove_all(e.path, ec) > 0;
    case Removal::File: return ::unlink(e.path.c_str()) == 0;
    case Removal::EmptyDir: return ::rmdir(e.path.c_str()) == 0;
  }
  return false;
}

[[noreturn]] void wait_for_signal() {
  const sigset_t set = handled_signals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  // Taken and never released: no step under hold_off() starts after this, and none is cut.
  Registry& r = registry();
  r.mutex.lock();
  std::string removed;
  for (auto it = r.entries.rbegin(); it != r.entries.rend(); ++it) {
    if (remove_entry(*it) && it->how == Removal::Tree) removed += (removed.empty() ? "" : ", ") + it->path;
  }
  const char* name = sigabbrev_np(sig);
  const std::string line = "\nshardmerge: interrupted by " + (name ? "SIG" + std::string(name) : "a signal") +
                           (removed.empty() ? "" : "; removed the unfinished output " + removed) + "\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  ::_exit(128 + sig);
}

}  // namespace

void install_handler() {
  const sigset_t set = handled_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(wait_for_signal).detach();
}

Registration::Registration(std::string path, Removal how) {
  Registry& r = registry();
  std::lock_guard<std::recursive_mutex> lock(r.mutex);
  id_ = r.next_id++;
  r.entries.push_back({id_, std::move(path), how});
}

Registration::Registration(Registration&& other) noexcept : id_(std::exchange(other.id_, 0)) {}

Registration& Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    Registration gone(std::move(*this));
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

Registration::~Registration() {
  if (!id_) return;
  Registry& r = registry();
  std::lock_guard<std::recursive_mutex> lock(r.mutex);
  std::erase_if(r.entries, [&](const Entry& e) { return e.id == id_; });
}

std::unique_lock<std::recursive_mutex> hold_off() { return std::unique_lock<std::recursive_mutex>(registry().mutex); }

}  // namespace shardmerge::interrupt
