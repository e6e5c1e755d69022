// SIGINT, SIGTERM and SIGHUP end shardmerge without leaving anything behind: the signals are
// blocked in every thread and one dedicated thread takes them with sigwait, so no work runs in
// a signal handler. That thread removes what is registered here (the output's temp directory,
// the target's lock file, parent directories the run created), says so on stderr, and ends the
// process with 128 + the signal number; the workers stop with the process.
#pragma once

#include <mutex>
#include <string>

namespace shardmerge::interrupt {

// Blocks the three signals and starts the thread that waits for them. Call once, first thing
// in main, before any other thread exists (threads inherit the blocked mask). Without it (unit
// tests) the registrations below are kept but nothing acts on them.
void install_handler();

enum class Removal {
  Tree,      // remove_all: the temp directory
  File,      // unlink: the lock file
  EmptyDir,  // rmdir, only if empty: a parent directory this run created
};

// Something to remove if the process is interrupted; removed in the reverse order of
// registration (a temp directory before the parent it was made in). Unregisters when it goes.
class Registration {
 public:
  Registration() = default;
  Registration(std::string path, Removal how);
  Registration(Registration&& other) noexcept;
  Registration& operator=(Registration&& other) noexcept;
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration();

 private:
  unsigned long id_ = 0;
};

// Held around a step that must not be cut in half by the cleanup: creating the temp directory
// and registering it, renaming it into place. The interrupt thread waits for it, then exits.
// The same thread may register and unregister while holding it.
std::unique_lock<std::recursive_mutex> hold_off();

}  // namespace shardmerge::interrupt
