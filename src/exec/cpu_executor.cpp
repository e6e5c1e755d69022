// The CPU executor: a pool of threads pulling Tasks. Runs go file to file (pread + CRC-32
// [+ cast] + pwrite; copy_file_range for same-dtype runs with --no-crc); slabs gather through
// bounded staging; LoRA folds run slab by slab through an fp32 sgemm. All staging comes from
// one budget derived from --memory-limit.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "exec/blas.hpp"
#include "exec/convert_cpu.hpp"
#include "exec/gather.hpp"
#include "exec/io.hpp"
#include "exec/sources.hpp"
#include "exec/tasks.hpp"
#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"
#include "util/rss.hpp"
#include "shardmerge/trace.hpp"

namespace shardmerge {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
// Bytes per task (run, slab, fold slab), below the staging size: a few MiB keep what a task
// reads, converts and writes in cache, and hold the output file's lock only briefly (buffered
// writes to one file are serialised, and the waiting writer spins on its CPU). 32 MiB tasks
// made an fp32 -> bf16 merge 3x slower on 2 cores than 2 MiB ones.
constexpr uint64_t kTaskBytes = 2 * kMiB;
// Resident memory that is not staging: code, libraries, OpenBLAS per-thread buffers, plan.
constexpr uint64_t kReserve = 64 * kMiB;

struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n), data(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64))) {
    if (!data) throw Error("out of memory allocating a " + std::to_string(n) + "-byte staging buffer");
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  size_t size;
  uint8_t* data;
};

// Bytes that fold tasks may hold beyond the workers' fixed staging; a task waits until its
// share is free, so the total never exceeds the budget.
class MemoryBudget {
 public:
  explicit MemoryBudget(uint64_t bytes) : free_(bytes), total_(bytes) {}
  void acquire(uint64_t n) {
    if (n > total_)
      throw Error("needs " + std::to_string(n / kMiB) + " MiB of staging, more than --memory-limit leaves (" +
                  std::to_string(total_ / kMiB) + " MiB); raise --memory-limit");
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return free_ >= n; });
    free_ -= n;
  }
  void release(uint64_t n) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free_ += n;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t free_, total_;
};

// Per-worker memory that fold tasks need beyond the two staging buffers (all of A or B, and
// the slab's rows of the other): grown from the budget on demand, kept for the next task,
// given back when the worker ends. Reusing it avoids page-faulting fresh memory per task.
// Growing gives the old buffer back before waiting for the larger one: a worker that held its
// old share while waiting could wait for itself (one thread, a limit below old + new) or for
// another worker waiting the same way.
class FoldScratch {
 public:
  explicit FoldScratch(MemoryBudget& budget) : budget_(budget) {}
  ~FoldScratch() {
    if (buffer_) budget_.release(buffer_->size);
  }
  uint8_t* reserve(size_t bytes) {
    if (!buffer_ || buffer_->size < bytes) {
      if (buffer_) budget_.release(buffer_->size);
      buffer_.reset();
      budget_.acquire(bytes);
      try {
        buffer_ = std::make_unique<AlignedBuffer>(bytes);
      } catch (...) {
        budget_.release(bytes);
        throw;
      }
    }
    return buffer_->data;
  }

 private:
  MemoryBudget& budget_;
  std::unique_ptr<AlignedBuffer> buffer_;
};

class CpuRun {
 public:
  // Sizes the staging, cuts the tasks, then opens the sources they read.
  CpuRun(const MergePlan& plan, const OutputSink& out, const ExecOptions& opt)
      : plan_(plan), out_(out), opt_(opt), limits_(size_staging()), tasks_(make_tasks(plan, limits_)),
        files_(plan, source_files_read(plan, tasks_), opt.check_crc, opt.rank, opt.remote), sources_(files_.fds()) {}

  ExecStats run() {
    // Load the BLAS before the workers start: loading sets OPENBLAS_CORETYPE (setenv is not
    // safe beside other threads), and a missing library fails before any work is done.
    if (std::any_of(plan_.tensors.begin(), plan_.tensors.end(), [](const OutputTensor& t) { return t.lora.has_value(); }))
      blas_sgemm();
    std::vector<std::thread> workers;
    for (unsigned i = 0; i < std::min<size_t>(threads_, std::max<size_t>(1, tasks_.size())); ++i)
      workers.emplace_back([this] { worker(); });
    for (auto& w : workers) w.join();
    if (error_) std::rethrow_exception(error_);
    ExecStats stats;
    stats.records_checked = files_.finish();
    stats.threads = static_cast<unsigned>(workers.size());
    stats.peak_read_bytes_in_flight = files_.peak_read_bytes_in_flight();
    stats.bytes_read = bytes_read_.load();
    stats.bytes_written = bytes_written_.load();
    stats.tasks = tasks_.size();
    stats.lora_folds = folds_.load();
    return stats;
  }

 private:
  // Sets threads_, staging_ and budget_ from --memory-limit and --threads; returns the task sizes.
  TaskLimits size_staging() {
    // Two staging buffers per worker (read, convert) take half of what the limit leaves;
    // fold tasks draw on the other half. Workers beyond what that half holds at one task's
    // size each are not started: the memory limit wins over --threads.
    const uint64_t baseline = current_rss_bytes() + kReserve;
    if (opt_.memory_limit < baseline + 8 * kMiB)
      throw usage_error("--memory-limit " + std::to_string(opt_.memory_limit / kMiB) + " MiB is below the " +
                        std::to_string((baseline + 8 * kMiB) / kMiB) + " MiB this process needs at minimum");
    const uint64_t avail = opt_.memory_limit - baseline;
    const auto affordable = static_cast<unsigned>(std::max<uint64_t>(1, avail / 2 / (2 * kTaskBytes)));
    // Reads through a data plane mostly wait on the network: more threads keep more in flight.
    const unsigned wanted = std::max(default_io_threads(), opt_.remote ? opt_.remote->reads_in_flight() : 0u);
    threads_ = std::min(opt_.threads ? opt_.threads : wanted, affordable);
    staging_ = std::clamp<uint64_t>(avail / 2 / (2 * threads_), kMiB, 32 * kMiB);
    budget_ = std::make_unique<MemoryBudget>(avail - 2 * staging_ * threads_);
    return TaskLimits{std::min(staging_, kTaskBytes), std::min(staging_, kTaskBytes)};
  }

  void worker() {
    try {
      AlignedBuffer read(staging_), conv(staging_);
      FoldScratch scratch(*budget_);
      while (!failed_.load()) {
        const size_t i = next_.fetch_add(1);
        if (i >= tasks_.size()) break;
        const Task& t = tasks_[i];
        throw_if_cancelled(opt_.cancel);
        try {
          switch (t.kind) {
            case Task::Kind::Run: run_task(t, read, conv); break;
            case Task::Kind::Slab: slab_task(t, read, conv); break;
            case Task::Kind::Fold: fold_task(t, read, conv, scratch); break;
          }
        } catch (Error& e) {
          e.tensor(plan_.tensors[t.tensor].name);
          throw;
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      failed_ = true;
    }
  }

  void wrote(uint64_t n) {
    bytes_written_ += n;
    if (opt_.on_written) opt_.on_written(n);
  }

  void run_task(const Task& t, AlignedBuffer& read, AlignedBuffer& conv) {
    const OutputTensor& out = plan_.tensors[t.tensor];
    const uint64_t in_bytes = t.count * dtype_size(t.src_dtype);
    const uint64_t out_bytes = t.count * dtype_size(out.dtype);
    if (t.src_dtype == out.dtype) {
      auto scope = trace("copy", in_bytes);
      // copy_file_range keeps the bytes in the kernel, where they cannot be checked.
      if (sources_.must_read(t.src_file) ||
          !out_.copy_from(sources_.fds[t.src_file], t.src_offset, out.file, t.dst_offset, in_bytes)) {
        sources_.read(t.src_file, t.src_offset, read.data, in_bytes);
        out_.write(out.file, t.dst_offset, read.data, in_bytes);
      }
    } else {
      {
        auto scope = trace("read", in_bytes);
        sources_.read(t.src_file, t.src_offset, read.data, in_bytes);
      }
      {
        auto scope = trace("cast", out_bytes);
        convert_elements(read.data, t.src_dtype, 1, conv.data, out.dtype, t.count);
      }
      auto scope = trace("write", out_bytes);
      out_.write(out.file, t.dst_offset, conv.data, out_bytes);
    }
    bytes_read_ += in_bytes;
    wrote(out_bytes);
  }

  void slab_task(const Task& t, AlignedBuffer& read, AlignedBuffer& conv) {
    const OutputTensor& out = plan_.tensors[t.tensor];
    const uint64_t out_bytes = t.box.numel() * dtype_size(out.dtype);
    {
      auto scope = trace("gather", out_bytes);
      Gatherer g(sources_, read.data, read.size);
      bytes_read_ += g.gather(out.copies, t.box, conv.data, out.dtype);
    }
    auto scope = trace("write", out_bytes);
    out_.write(out.file, t.dst_offset, conv.data, out_bytes);
    wrote(out_bytes);
  }

  // W' = W + scale * B @ A (or its transpose for fan_in_fan_out / embeddings) in fp32, in
  // slabs of W's rows; the whole A (or B) stays resident for the tensor. The fp32 slab lives
  // in `conv`, and once the slab's gathers are done its cast result goes to `read`.
  void fold_task(const Task& t, AlignedBuffer& read, AlignedBuffer& conv, FoldScratch& scratch) {
    const OutputTensor& out = plan_.tensors[t.tensor];
    const LoraFold& f = *out.lora;
    const int64_t rows = out.shape.at(0), cols = out.shape.at(1), r = f.rank;
    const bool tr = f.fan_in_fan_out;
    // Non-transposed: W [out, in] += B[out, r] @ A[r, in]: slab rows of W need rows of B and all of A.
    // Transposed:     W [in, out] += (B @ A)^T = A^T @ B^T: slab rows of W need columns of A and all of B.
    const uint64_t slab_bytes = std::min(staging_, kTaskBytes);
    const int64_t slab_rows = std::clamp<int64_t>(static_cast<int64_t>(slab_bytes / (4 * cols)), 1, rows);
    if (static_cast<uint64_t>(slab_rows * cols) * 4 > staging_)
      throw Error("a row of " + std::to_string(cols) + " elements does not fit the staging buffers; raise --memory-limit");
    const size_t resident = static_cast<size_t>(r * cols) * 4;  // all of A [r, in] or of B [out, r]
    const size_t part_at = (resident + 63) / 64 * 64;
    uint8_t* arena = scratch.reserve(part_at + static_cast<size_t>(slab_rows * r) * 4);
    auto* all = reinterpret_cast<float*>(arena);
    auto* p = reinterpret_cast<float*>(arena + part_at);
    auto* w = reinterpret_cast<float*>(conv.data);

    Gatherer g(sources_, read.data, read.size);
    {
      auto scope = trace("read", resident);
      bytes_read_ += tr ? g.gather(f.b, Box{{0, 0}, {cols, r}}, all, DType::F32)
                        : g.gather(f.a, Box{{0, 0}, {r, cols}}, all, DType::F32);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += slab_rows) {
      throw_if_cancelled(opt_.cancel);  // a fold task is a whole tensor: stop between its slabs
      const int64_t n = std::min(slab_rows, rows - r0);
      {
        auto scope = trace("gather", static_cast<uint64_t>(n * cols) * 4);
        bytes_read_ += g.gather(out.copies, Box{{r0, 0}, {n, cols}}, w, DType::F32);
        bytes_read_ += tr ? g.gather(f.a, Box{{0, r0}, {r, n}}, p, DType::F32)
                          : g.gather(f.b, Box{{r0, 0}, {n, r}}, p, DType::F32);
      }
      {
        auto scope = trace("fold", static_cast<uint64_t>(2 * n * cols * r));
        const auto scale = static_cast<float>(f.scale);
        const SgemmFn sgemm = blas_sgemm();
        if (tr) {  // W[n, out] += scale * A_cols^T [n, r] @ B^T [r, out]
          sgemm(CblasRowMajor, CblasTrans, CblasTrans, static_cast<int>(n), static_cast<int>(cols), static_cast<int>(r),
                scale, p, static_cast<int>(n), all, static_cast<int>(r), 1.0f, w, static_cast<int>(cols));
        } else {  // W[n, in] += scale * B_rows [n, r] @ A [r, in]
          sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(cols),
                static_cast<int>(r), scale, p, static_cast<int>(r), all, static_cast<int>(cols), 1.0f, w,
                static_cast<int>(cols));
        }
        const auto total = static_cast<size_t>(n * cols);
        if (const size_t i = convert_finite_f32(w, read.data, out.dtype, total); i < total)
          throw Error("LoRA fold produced a non-finite value at [" + std::to_string(r0 + static_cast<int64_t>(i) / cols) +
                      ", " + std::to_string(static_cast<int64_t>(i) % cols) + "]");
      }
      const uint64_t bytes = static_cast<uint64_t>(n * cols) * dtype_size(out.dtype);
      auto scope = trace("write", bytes);
      out_.write(out.file, out.offset + static_cast<uint64_t>(r0 * cols) * dtype_size(out.dtype), read.data, bytes);
      wrote(bytes);
    }
    ++folds_;
  }

  Trace::Scope trace(const char* name, uint64_t bytes) {
    return opt_.trace ? opt_.trace->scope(name, bytes) : Trace::Scope(nullptr, name, bytes);
  }

  const MergePlan& plan_;
  const OutputSink& out_;
  const ExecOptions& opt_;
  // In this order: size_staging() sets these three while limits_ is initialised.
  unsigned threads_ = 1;
  uint64_t staging_ = 0;
  std::unique_ptr<MemoryBudget> budget_;
  TaskLimits limits_;
  std::vector<Task> tasks_;
  OpenSources files_;
  const SourceFds& sources_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, folds_{0};
};

class CpuExecutor : public Executor {
 public:
  std::string name() const override { return "cpu"; }
  ExecStats run(const MergePlan& plan, const OutputSink& out, const ExecOptions& options) override {
    CpuRun run(plan, out, options);
    return run.run();
  }
};

}  // namespace

std::unique_ptr<Executor> make_cpu_executor() { return std::make_unique<CpuExecutor>(); }

}  // namespace shardmerge
