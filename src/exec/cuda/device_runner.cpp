#include "exec/cuda/device_runner.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "exec/fill.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::cuda {
namespace {

// Reads of one fill are split or batched into jobs for the I/O pool: one per pool thread, of
// 256 KiB to 4 MiB. An FSDP piece is often a few MiB: read as one job it ran at one thread's
// page-cache copy rate (5.6 GB/s on an H200 node, measured), the whole pipeline's limit.
constexpr uint64_t kMinReadJobBytes = 256ull << 10;
constexpr uint64_t kMaxReadJobBytes = 4ull << 20;
constexpr uint64_t kNoNonFinite = ~0ull;

}  // namespace

Staging::Cost Staging::pinned() const {
  return {kInputs * kDescriptorBytes + kOutputs * kFlagBytes, kInputs + kOutputs};
}

// The same buffers, and with folds the fp32 slab, the other operand's rows, the resident operand
// and cuBLAS's workspace.
Staging::Cost Staging::device() const {
  const Cost p = pinned();
  return folds ? Cost{p.fixed + resident + kBlasWorkspace, p.per_chunk + 2} : p;
}

int64_t fold_slab_rows(const OutputTensor& t, uint64_t chunk) {
  const auto cols = static_cast<uint64_t>(t.shape.at(1)), rank = static_cast<uint64_t>(t.lora->rank);
  const uint64_t widest = std::max<uint64_t>(4, dtype_size(t.dtype));
  return std::min<int64_t>(static_cast<int64_t>(chunk / (widest * std::max<uint64_t>({cols, rank, 1}))), t.shape.at(0));
}

void SharedRun::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::move(e);
  }
  failed_ = true;
}

DeviceRunner::DeviceRunner(int device, cublasHandle_t blas, const Staging& staging, SharedRun& run)
    : device_(device),
      blas_(blas),
      staging_(staging),
      run_(run),
      h2d_(make_stream()),
      compute_(make_stream()),
      d2h_(make_stream()),
      inputs_(Staging::kInputs),
      outputs_(Staging::kOutputs),
      busy_(Staging::kOutputs) {
  for (InputSlot& s : inputs_) {
    s.host = PinnedMemory(Staging::kDescriptorBytes + staging.chunk);
    s.dev = DeviceMemory(Staging::kDescriptorBytes + staging.chunk);
    s.copied = make_event();
    s.consumed = make_event();
  }
  for (OutputSlot& o : outputs_) {
    o.host = PinnedMemory(staging.chunk + Staging::kFlagBytes);
    o.dev = DeviceMemory(staging.chunk + Staging::kFlagBytes);
    o.ready = make_event();
    o.fetched = make_event();
  }
  if (staging.folds) {
    w32_ = DeviceMemory(staging.chunk);
    part_ = DeviceMemory(staging.chunk);
    resident_ = DeviceMemory(staging.resident);
    workspace_ = DeviceMemory(Staging::kBlasWorkspace);
    check(cublas().set_stream(blas_, compute_.get()), "cublasSetStream");
    check(cublas().set_workspace(blas_, workspace_.data(), workspace_.size()), "cublasSetWorkspace");
    // Plain fp32 (no TF32): the fold must stay within an output ulp of the CPU's sgemm.
    check(cublas().set_math_mode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
}

DeviceRunner::~DeviceRunner() {
  wait_for_writes();
  for (const Stream* s : {&h2d_, &compute_, &d2h_}) cudaStreamSynchronize(s->get());
}

void DeviceRunner::run(const std::vector<Task>& tasks) {
  for (size_t i = 0; i < tasks.size();) {
    if (run_.failed()) break;
    throw_if_cancelled(run_.options.cancel);
    const Task& t = tasks[i];
    size_t done = 1;
    try {
      switch (t.kind) {
        case Task::Kind::Run: done = run_tasks(tasks, i); break;
        case Task::Kind::Slab: slab_task(t); break;
        case Task::Kind::Fold: fold_task(t); break;
      }
    } catch (Error& e) {
      e.tensor(run_.plan.tensors[t.tensor].name);
      throw;
    }
    i += done;
  }
}

size_t DeviceRunner::run_tasks(const std::vector<Task>& tasks, size_t first) {
  const Task& t = tasks[first];
  const OutputTensor& out = run_.plan.tensors[t.tensor];
  Lease lease(*this, acquire_output());
  if (t.src_dtype == out.dtype) {
    const Output where{t.tensor, out.file, t.dst_offset, t.count * dtype_size(out.dtype)};
    run_.bytes_read += t.count * dtype_size(t.src_dtype);
    // Nothing to convert: the bytes go file to file on an I/O thread and never near the GPU.
    in_background(lease, t.tensor, [this, t, where](OutputSlot& o) {
      if (run_.failed()) return;
      auto scope = trace("copy", where.bytes);
      // copy_file_range keeps the bytes in the kernel, where they cannot be checked.
      if (!run_.sources.must_read(t.src_file) &&
          run_.out.copy_from(run_.sources.fds[t.src_file], t.src_offset, where.file, where.offset, where.bytes)) {
        wrote(where.bytes);
      } else {
        run_.sources.read(t.src_file, t.src_offset, o.host.data(), where.bytes);
        write(where, o.host.data());
      }
    });
    return 1;
  }
  // Consecutive casts of one tensor whose outputs adjoin (an FSDP tensor's rank pieces, often a
  // few MiB each) share one fill, one kernel and one download: per-fill costs (event waits, pool
  // hand-offs) dominated when each piece went alone.
  const uint64_t in_size = dtype_size(t.src_dtype), out_size = dtype_size(out.dtype);
  std::vector<FillRead> reads;
  uint64_t count = 0;
  size_t n = 0;
  for (; first + n < tasks.size(); ++n) {
    const Task& next = tasks[first + n];
    const bool joins = n == 0 || (next.kind == Task::Kind::Run && next.tensor == t.tensor &&
                                  next.src_dtype == t.src_dtype && next.dst_offset == t.dst_offset + count * out_size &&
                                  (count + next.count) * std::max(in_size, out_size) <= staging_.chunk);
    if (!joins) break;
    reads.push_back({next.src_file, next.src_offset, count * in_size, next.count * in_size});
    count += next.count;
  }
  const Output where{t.tensor, out.file, t.dst_offset, count * out_size};
  run_.bytes_read += count * in_size;
  InputSlot& s = next_input();
  read_all(reads, s.host.data() + Staging::kDescriptorBytes);
  upload(s, 0, count * in_size);
  kernels::launch_cast(s.dev.data() + Staging::kDescriptorBytes, t.src_dtype, lease.slot().dev.data(), out.dtype, count,
                       compute_.get());
  consumed(s);
  send(lease, where);
  return n;
}

void DeviceRunner::slab_task(const Task& t) {
  const OutputTensor& out = run_.plan.tensors[t.tensor];
  Lease lease(*this, acquire_output());
  gather(out.copies, t.box, lease.slot().dev.data(), out.dtype);
  send(lease, Output{t.tensor, out.file, t.dst_offset, t.box.numel() * dtype_size(out.dtype)});
}

// W' = W + scale * B @ A (or its transpose), slab by slab of W's rows, as the CPU's fold_task:
// all of A (or B) stays on the GPU, each slab gathers its rows of W and of the other operand
// as fp32, cuBLAS accumulates into W, and one kernel checks and casts the result.
void DeviceRunner::fold_task(const Task& t) {
  const OutputTensor& out = run_.plan.tensors[t.tensor];
  const LoraFold& f = *out.lora;
  const int64_t rows = out.shape.at(0), cols = out.shape.at(1), r = f.rank;
  const bool tr = f.fan_in_fan_out;
  const int64_t slab_rows = fold_slab_rows(out, staging_.chunk);
  if (slab_rows < 1)
    throw Error("a row of " + std::to_string(cols) + " elements does not fit the staging buffers; raise --memory-limit");
  const uint64_t out_elem = dtype_size(out.dtype);
  auto* all = reinterpret_cast<float*>(resident_.data());
  auto* w = reinterpret_cast<float*>(w32_.data());
  auto* p = reinterpret_cast<float*>(part_.data());
  if (tr) {
    gather(f.b, Box{{0, 0}, {cols, r}}, all, DType::F32);
  } else {
    gather(f.a, Box{{0, 0}, {r, cols}}, all, DType::F32);
  }
  for (int64_t r0 = 0; r0 < rows && !run_.failed(); r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, rows - r0);
    Lease lease(*this, acquire_output());
    gather(out.copies, Box{{r0, 0}, {n, cols}}, w, DType::F32);
    if (tr) {
      gather(f.a, Box{{0, r0}, {r, n}}, p, DType::F32);
    } else {
      gather(f.b, Box{{r0, 0}, {n, r}}, p, DType::F32);
    }
    kernels::lora_accumulate(blas_, {tr, n, cols, r, static_cast<float>(f.scale), p, all, w});
    uint8_t* slot = lease.slot().dev.data();
    auto* flag = reinterpret_cast<unsigned long long*>(slot + staging_.chunk);
    check(cudaMemsetAsync(flag, 0xFF, sizeof *flag, compute_.get()), "cudaMemsetAsync");
    const auto count = static_cast<uint64_t>(n * cols);
    kernels::launch_finite_cast(w, count, slot, out.dtype, flag, compute_.get());
    send(lease, Output{t.tensor, out.file, out.offset + static_cast<uint64_t>(r0 * cols) * out_elem, count * out_elem,
                       true, r0, cols});
  }
  ++run_.folds;
}

void DeviceRunner::gather(const std::vector<Slice>& pieces, const Box& box, void* dst, DType to) {
  const std::vector<int64_t> dst_strides = row_major_strides(box.extent);
  const std::vector<GatherRegion> regions = gather_regions(pieces, box, staging_.chunk);
  for (size_t next = 0; next < regions.size();) {
    InputSlot& s = next_input();
    const Fill fill = pack_fill(regions, next, staging_.chunk, dst_strides, to);
    const uint64_t descriptor_bytes = fill.regions.size() * sizeof(kernels::RegionCopy);
    std::memcpy(s.host.data(), fill.regions.data(), descriptor_bytes);
    read_all(fill.reads, s.host.data() + Staging::kDescriptorBytes);
    run_.bytes_read += fill.source_bytes;
    upload(s, descriptor_bytes, fill.bytes);
    kernels::launch_gather_box(reinterpret_cast<const kernels::RegionCopy*>(s.dev.data()),
                               static_cast<uint32_t>(fill.regions.size()), fill.max_numel,
                               s.dev.data() + Staging::kDescriptorBytes, dst, to, compute_.get());
    consumed(s);
  }
}

DeviceRunner::InputSlot& DeviceRunner::next_input() {
  InputSlot& s = inputs_[next_input_++ % inputs_.size()];
  check(cudaEventSynchronize(s.copied.get()), "waiting for an upload");
  return s;
}

void DeviceRunner::read_all(const std::vector<FillRead>& reads, uint8_t* data) {
  uint64_t total = 0;
  for (const FillRead& r : reads) total += r.bytes;
  const uint64_t step = 64ull << 10;
  const uint64_t job_bytes =
      std::clamp((total / std::max<uint64_t>(1, run_.io.size()) + step - 1) / step * step, kMinReadJobBytes, kMaxReadJobBytes);
  std::vector<std::function<void()>> jobs;
  std::vector<FillRead> batch;
  uint64_t batch_bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    jobs.emplace_back([this, data, b = std::move(batch)] {
      for (const FillRead& r : b)
        run_.sources.read(r.file, r.file_offset, data + r.offset, r.bytes);
    });
    batch.clear();
    batch_bytes = 0;
  };
  for (const FillRead& r : reads) {
    for (uint64_t done = 0; done < r.bytes;) {
      const uint64_t n = std::min(r.bytes - done, job_bytes - batch_bytes);
      batch.push_back({r.file, r.file_offset + done, r.offset + done, n});
      batch_bytes += n;
      done += n;
      if (batch_bytes == job_bytes) flush();
    }
  }
  flush();
  auto scope = trace("read", total);
  if (jobs.size() == 1) {
    jobs.front()();
  } else {
    run_.io.run_all(jobs);
  }
}

void DeviceRunner::upload(InputSlot& s, uint64_t descriptor_bytes, uint64_t data_bytes) {
  check(cudaStreamWaitEvent(h2d_.get(), s.consumed.get(), 0), "cudaStreamWaitEvent");
  if (descriptor_bytes)
    check(cudaMemcpyAsync(s.dev.data(), s.host.data(), descriptor_bytes, cudaMemcpyHostToDevice, h2d_.get()),
          "cudaMemcpyAsync (upload)");
  check(cudaMemcpyAsync(s.dev.data() + Staging::kDescriptorBytes, s.host.data() + Staging::kDescriptorBytes, data_bytes,
                        cudaMemcpyHostToDevice, h2d_.get()),
        "cudaMemcpyAsync (upload)");
  check(cudaEventRecord(s.copied.get(), h2d_.get()), "cudaEventRecord");
  check(cudaStreamWaitEvent(compute_.get(), s.copied.get(), 0), "cudaStreamWaitEvent");
}

void DeviceRunner::consumed(InputSlot& s) { check(cudaEventRecord(s.consumed.get(), compute_.get()), "cudaEventRecord"); }

DeviceRunner::OutputSlot& DeviceRunner::acquire_output() {
  const size_t i = next_output_++ % outputs_.size();
  busy_.acquire(i);
  return outputs_[i];
}

// The last thing an I/O job does with this runner (see BusySlots: it may be destroyed next).
void DeviceRunner::release(OutputSlot& o) { busy_.release(static_cast<size_t>(&o - outputs_.data())); }

void DeviceRunner::wait_for_writes() { busy_.wait_all_free(); }

void DeviceRunner::send(Lease& lease, const Output& where) {
  OutputSlot& o = lease.slot();
  check(cudaEventRecord(o.ready.get(), compute_.get()), "cudaEventRecord");
  check(cudaStreamWaitEvent(d2h_.get(), o.ready.get(), 0), "cudaStreamWaitEvent");
  check(cudaMemcpyAsync(o.host.data(), o.dev.data(), where.bytes, cudaMemcpyDeviceToHost, d2h_.get()),
        "cudaMemcpyAsync (download)");
  if (where.fold)
    check(cudaMemcpyAsync(o.host.data() + staging_.chunk, o.dev.data() + staging_.chunk, sizeof(uint64_t),
                          cudaMemcpyDeviceToHost, d2h_.get()),
          "cudaMemcpyAsync (download)");
  check(cudaEventRecord(o.fetched.get(), d2h_.get()), "cudaEventRecord");
  in_background(lease, where.tensor, [this, where](OutputSlot& slot) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaEventSynchronize(slot.fetched.get()), "waiting for a download");
    if (run_.failed()) return;
    if (where.fold) {
      uint64_t first = 0;
      std::memcpy(&first, slot.host.data() + staging_.chunk, sizeof first);
      if (first != kNoNonFinite)
        throw Error("LoRA fold produced a non-finite value at [" +
                    std::to_string(where.first_row + static_cast<int64_t>(first) / where.cols) + ", " +
                    std::to_string(static_cast<int64_t>(first) % where.cols) + "]");
    }
    write(where, slot.host.data());
  });
}

void DeviceRunner::in_background(Lease& lease, uint32_t tensor, std::function<void(OutputSlot&)> job) {
  OutputSlot& o = lease.hand_over();
  run_.io.submit([this, &o, tensor, job = std::move(job)] {
    try {
      job(o);
    } catch (Error& e) {
      e.tensor(run_.plan.tensors[tensor].name);
      run_.fail(std::current_exception());
    } catch (...) {
      run_.fail(std::current_exception());
    }
    release(o);
  });
}

void DeviceRunner::write(const Output& where, const uint8_t* data) {
  auto scope = trace("write", where.bytes);
  run_.out.write(where.file, where.offset, data, where.bytes);
  wrote(where.bytes);
}

void DeviceRunner::wrote(uint64_t bytes) {
  run_.bytes_written += bytes;
  if (run_.options.on_written) run_.options.on_written(bytes);
}

Trace::Scope DeviceRunner::trace(const char* name, uint64_t bytes) const {
  return run_.options.trace ? run_.options.trace->scope(name, bytes) : Trace::Scope(nullptr, name, bytes);
}

}  // namespace shardmerge::cuda
