// The executor seam: something that runs a MergePlan. The CPU executor and the CUDA executor
// implement it; neither parses anything, they only follow the plan.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shardmerge/error.hpp"
#include "shardmerge/plan.hpp"
#include "shardmerge/trace.hpp"

namespace shardmerge {


// Where tensor bytes go, addressed as (output file index, byte offset) of the plan: the files
// of an output tree (HfTreeWriter), or a comparison against a reference tree (verify).
// Implementations must accept concurrent calls for disjoint ranges.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void write(uint32_t file, uint64_t offset, const void* data, size_t n) const = 0;
  // Same bytes straight from a source file, where the sink can do it without a user-space
  // copy (copy_file_range). Returns false to have the caller read and write() instead.
  virtual bool copy_from(int src_fd, uint64_t src_offset, uint32_t file, uint64_t offset, uint64_t n) const {
    (void)src_fd, (void)src_offset, (void)file, (void)offset, (void)n;
    return false;
  }
};

// Reads of source bytes that another process of a multi-process merge holds (a file on that
// process's node): a transport (exec/dist) carries the request there and the bytes back.
class RemoteReader {
 public:
  virtual ~RemoteReader() = default;
  // Exactly n bytes of plan source `file` at `offset`, read by process `owner`; throws an Error
  // carrying the owner's message when it cannot read them.
  virtual void read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) = 0;
  // How many reads the executor should keep in flight to fill the link (each waits a round
  // trip); 0: no more than its usual threads.
  virtual unsigned reads_in_flight() const { return 0; }
};

struct ExecOptions {
  unsigned threads = 0;                // 0: two per core (default_io_threads)
  uint64_t memory_limit = 512ull << 20;  // peak resident memory the whole process may use
  // Check the zip CRC-32 of every record read (MergePlan::records) as the bytes stream through;
  // off (--no-crc) lets same-dtype copies stay in the kernel (copy_file_range).
  bool check_crc = true;
  // This process's rank in a multi-process merge, or -1 for a single process. A process with a
  // rank refuses to read a source that the plan says another rank owns (SourceFile::owner).
  int32_t rank = -1;
  // With a rank: where reads of sources another rank owns go (null: such reads are refused).
  RemoteReader* remote = nullptr;
  // Called with output bytes as they are written (a progress display), from any thread.
  std::function<void(uint64_t bytes)> on_written;
  // Set by the caller (the Python API, on Ctrl-C or a failing progress callback) to stop the run
  // at the next task boundary; the run then throws cancelled_error().
  const std::atomic<bool>* cancel = nullptr;
  Trace* trace = nullptr;  // phases, when --profile asks for them
};

inline Error cancelled_error() { return Error("cancelled"); }
inline void throw_if_cancelled(const std::atomic<bool>* cancel) {
  if (cancel && cancel->load(std::memory_order_relaxed)) throw cancelled_error();
}

struct ExecStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t tasks = 0;
  uint64_t lora_folds = 0;
  uint64_t records_checked = 0;  // zip records whose CRC-32 was verified
  unsigned threads = 0;           // worker threads (the CUDA executor: its I/O threads)
  uint64_t peak_read_bytes_in_flight = 0;  // source reads issued and not yet returned, at most
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string name() const = 0;
  virtual ExecStats run(const MergePlan& plan, const OutputSink& out, const ExecOptions& options) = 0;
};

std::unique_ptr<Executor> make_cpu_executor();

}  // namespace shardmerge
