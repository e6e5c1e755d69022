// One GPU's share of a merge, as a pipeline over fixed buffers. The device's host thread cuts
// each task into fills of staged source bytes: it preads a fill into pinned memory (through the
// I/O pool, in parallel) while the previous fill is on the GPU, uploads it on the H2D stream,
// and runs the kernels on the compute stream into an output slot. The slot comes back on the
// D2H stream and an I/O thread writes it to the sink while later tasks compute. Events order
// the streams; buffers are reused only after the event that frees them.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "exec/cuda/busy_slots.hpp"
#include "exec/cuda/cuda_resources.hpp"
#include "exec/cuda/io_pool.hpp"
#include "exec/fill.hpp"
#include "exec/gather.hpp"
#include "exec/tasks.hpp"
#include "kernels/gather_box.cuh"
#include "kernels/kernels.hpp"
#include "shardmerge/executor.hpp"
#include "shardmerge/trace.hpp"

namespace shardmerge::cuda {

// Buffer sizes of one device, chosen by the executor from --memory-limit and --gpu-memory.
struct Staging {
  static constexpr int kInputs = 2;   // fills in flight: one being read while one is on the GPU
  static constexpr int kOutputs = 3;  // outputs in flight: computing, coming back, being written
  // Each fill starts with the descriptors of the regions it holds.
  static constexpr uint64_t kDescriptorBytes = (kernels::kMaxRegionsPerLaunch * sizeof(kernels::RegionCopy) + 255) / 256 * 256;
  static constexpr uint64_t kFlagBytes = 256;  // after an output slot's bytes: the fold's non-finite flag
  static constexpr uint64_t kBlasWorkspace = 4ull << 20;

  uint64_t chunk = 0;     // staged source bytes per fill, output bytes per slot, fp32 fold slab bytes
  uint64_t resident = 0;  // the largest fold operand kept on the GPU (all of A or all of B, fp32)
  bool folds = false;

  // Memory of one device's buffers, as fixed + per_chunk * chunk bytes.
  struct Cost {
    uint64_t fixed = 0, per_chunk = 0;
  };
  Cost pinned() const;
  Cost device() const;
};

// Rows of W per fold slab: the fp32 slab, the slab's rows of the other operand and its output
// must each fit one chunk. 0 when not even one row does.
int64_t fold_slab_rows(const OutputTensor& t, uint64_t chunk);

// What the devices of one run share: the plan, the sink, the I/O threads, the first failure
// (every device stops at its next step) and the counters.
struct SharedRun {
  SharedRun(const MergePlan& p, const SourceFds& s, const OutputSink& o, const ExecOptions& opt, IoPool& pool)
      : plan(p), sources(s), out(o), options(opt), io(pool) {}
  const MergePlan& plan;
  const SourceFds& sources;
  const OutputSink& out;
  const ExecOptions& options;
  IoPool& io;

  void fail(std::exception_ptr e);
  bool failed() const { return failed_.load(); }
  std::exception_ptr error() const { return error_; }

  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, folds{0};

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

class DeviceRunner {
 public:
  // On the device's own thread, with that device current. `blas` is null when the plan has no folds.
  DeviceRunner(int device, cublasHandle_t blas, const Staging& staging, SharedRun& run);
  // Waits for the writes still queued and for the streams: they use this object's buffers.
  ~DeviceRunner();
  DeviceRunner(const DeviceRunner&) = delete;
  DeviceRunner& operator=(const DeviceRunner&) = delete;

  void run(const std::vector<Task>& tasks);

 private:
  struct InputSlot {
    PinnedMemory host;
    DeviceMemory dev;
    Event copied;    // its upload is done: the host may refill it
    Event consumed;  // the kernels that read it are done: the next upload may overwrite it
  };
  struct OutputSlot {
    PinnedMemory host;
    DeviceMemory dev;
    Event ready;    // computed
    Event fetched;  // back in host memory
  };
  // Where an output slot's bytes go; a fold slab also has its non-finite flag checked.
  struct Output {
    uint32_t tensor = 0;
    uint32_t file = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
    bool fold = false;
    int64_t first_row = 0, cols = 0;
  };

  // An output slot from acquire_output until an I/O job takes it over; freed if a step before
  // that throws, so that no one waits for it forever.
  class Lease {
   public:
    Lease(DeviceRunner& runner, OutputSlot& slot) : runner_(runner), slot_(&slot) {}
    ~Lease() {
      if (slot_) runner_.release(*slot_);
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    OutputSlot& slot() const { return *slot_; }
    OutputSlot& hand_over() { return *std::exchange(slot_, nullptr); }

   private:
    DeviceRunner& runner_;
    OutputSlot* slot_;
  };

  // The Run task at `first`, joined with the casts after it that continue its output; returns
  // how many tasks it did.
  size_t run_tasks(const std::vector<Task>& tasks, size_t first);
  void slab_task(const Task& t);
  void fold_task(const Task& t);
  // Fills the device box `dst` (row-major over box.extent, dtype `to`), fill by fill.
  void gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to);

  InputSlot& next_input();
  // Reads into `data` (a fill's pinned bytes), in parallel on the I/O pool.
  void read_all(const std::vector<FillRead>& reads, uint8_t* data);
  void upload(InputSlot& s, uint64_t descriptor_bytes, uint64_t data_bytes);
  void consumed(InputSlot& s);

  OutputSlot& acquire_output();
  void release(OutputSlot& o);
  void wait_for_writes();
  // Copies the slot back and queues its write.
  void send(Lease& lease, const Output& where);
  // Runs `job(slot)` on the I/O pool, records its failure, and frees the slot after it.
  void in_background(Lease& lease, uint32_t tensor, std::function<void(OutputSlot&)> job);
  void write(const Output& where, const uint8_t* data);
  void wrote(uint64_t bytes);

  Trace::Scope trace(const char* name, uint64_t bytes) const;

  int device_;
  cublasHandle_t blas_;
  Staging staging_;
  SharedRun& run_;
  Stream h2d_, compute_, d2h_;
  std::vector<InputSlot> inputs_;
  std::vector<OutputSlot> outputs_;
  DeviceMemory w32_, part_, resident_, workspace_;
  uint64_t next_input_ = 0, next_output_ = 0;
  BusySlots<> busy_;  // output slots between acquire_output and the end of their write
};

}  // namespace shardmerge::cuda
