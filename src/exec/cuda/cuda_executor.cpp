#include "exec/cuda/cuda_executor.hpp"

#include <algorithm>
#include <set>
#include <thread>

#include "exec/cuda/device_runner.hpp"
#include "exec/cuda/host_memory.hpp"
#include "exec/io.hpp"
#include "exec/sources.hpp"
#include "shardmerge/error.hpp"
#include "util/rss.hpp"

namespace shardmerge {
namespace {

using cuda::check;

constexpr uint64_t kMiB = 1ull << 20;
// Resident memory not measured when the budget is set: tasks, I/O thread stacks, the plan's growth.
constexpr uint64_t kReserve = 64 * kMiB;
// Chunks are multiples of 64 KiB, at least one such step (tests use that to cut small tensors
// into many fills) and at most 64 MiB (larger fills only delay the start of the pipeline).
constexpr uint64_t kChunkStep = 64ull << 10;
constexpr uint64_t kMaxChunk = 64 * kMiB;
constexpr uint64_t kDefaultGpuMemory = 4ull << 30;

std::string mib(uint64_t bytes) { return std::to_string((bytes + kMiB - 1) / kMiB) + " MiB"; }

// Host memory of one device's buffers, as fixed + per_chunk * chunk: its pinned buffers plus
// one sink buffer per output in flight (a comparing sink reads the reference into one).
cuda::Staging::Cost host_cost(const cuda::Staging& s) {
  return {s.pinned().fixed, s.pinned().per_chunk + cuda::Staging::kOutputs};
}

class CudaExecutor : public Executor {
 public:
  CudaExecutor(std::vector<int> devices, uint64_t gpu_memory) : devices_(std::move(devices)), gpu_memory_(gpu_memory) {
    std::set<std::string> models;
    name_ = "cuda:";
    for (size_t i = 0; i < devices_.size(); ++i) {
      cudaDeviceProp prop{};
      check(cudaGetDeviceProperties(&prop, devices_[i]), "cudaGetDeviceProperties");
      models.insert(prop.name);
      if (i) name_ += ',';
      name_ += std::to_string(devices_[i]);
    }
    name_ += " (";
    for (const auto& m : models) name_ += (m == *models.begin() ? "" : " + ") + m;
    name_ += ')';
  }

  std::string name() const override { return name_; }

  ExecStats run(const MergePlan& plan, const OutputSink& out, const ExecOptions& options) override {
    const bool folds = std::any_of(plan.tensors.begin(), plan.tensors.end(), [](const OutputTensor& t) { return t.lora.has_value(); });
    // --memory-limit counts the contexts and cuBLAS: a limit that cannot hold them is refused
    // before a context is created (creating it would already pass the limit).
    const cuda::Staging::Cost least = host_cost(cuda::Staging{});
    cuda::require_host_memory_for_cuda(options.memory_limit, current_rss_bytes(), kReserve,
                                       devices_.size() * (least.fixed + least.per_chunk * kChunkStep), devices_.size(),
                                       folds);
    // Contexts and cuBLAS handles first: they take host memory that staging must not count on.
    std::vector<cuda::Cublas> blas(devices_.size());
    std::vector<uint64_t> free(devices_.size());
    for (size_t i = 0; i < devices_.size(); ++i) {
      check(cudaSetDevice(devices_[i]), "cudaSetDevice");
      check(cudaFree(nullptr), "creating the CUDA context");
      if (folds) {
        cublasHandle_t h = nullptr;
        check(cuda::cublas().create(&h), "cublasCreate");
        blas[i] = cuda::Cublas(h);
      }
      size_t available = 0, total = 0;
      check(cudaMemGetInfo(&available, &total), "cudaMemGetInfo");
      free[i] = available;
    }
    cuda::Staging staging = size_staging(plan, options, folds, free);
    // A re-run (into a comparing sink, as the tests do) cuts the same fold slabs, so cuBLAS picks
    // the same kernels and the products agree bit for bit; the first run's chunk is kept unless
    // memory got tighter.
    staging.chunk = chunk_ = chunk_ ? std::min(chunk_, staging.chunk) : staging.chunk;
    const std::vector<Task> tasks = make_tasks(plan, TaskLimits{staging.chunk, staging.chunk});
    const std::vector<std::vector<Task>> parts = split_by_bytes(plan, tasks, devices_.size());
    OpenSources sources(plan, source_files_read(plan, tasks), options.check_crc, options.rank, options.remote);

    cuda::IoPool io(options.threads ? options.threads : default_io_threads());
    cuda::SharedRun shared(plan, sources.fds(), out, options, io);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < devices_.size(); ++i)
      threads.emplace_back([&, i] {
        try {
          check(cudaSetDevice(devices_[i]), "cudaSetDevice");
          cuda::DeviceRunner runner(devices_[i], blas[i].get(), staging, shared);
          runner.run(parts[i]);
        } catch (...) {
          shared.fail(std::current_exception());
        }
      });
    for (auto& t : threads) t.join();
    if (shared.error()) std::rethrow_exception(shared.error());

    ExecStats stats;
    stats.records_checked = sources.finish();
    stats.threads = io.size();
    stats.peak_read_bytes_in_flight = sources.peak_read_bytes_in_flight();
    stats.bytes_read = shared.bytes_read.load();
    stats.bytes_written = shared.bytes_written.load();
    stats.tasks = tasks.size();
    stats.lora_folds = shared.folds.load();
    return stats;
  }

 private:
  // One chunk size for every device: the largest that both budgets allow. Host: --memory-limit
  // less what the process holds once the contexts and cuBLAS exist (measured) and the kernels
  // they will load on first launch (estimated), for each device's host_cost. Device:
  // --gpu-memory (or the default) for the device's buffers.
  cuda::Staging size_staging(const MergePlan& plan, const ExecOptions& options, bool folds,
                             const std::vector<uint64_t>& free) const {
    cuda::Staging s;
    s.folds = folds;
    for (const OutputTensor& t : plan.tensors)
      if (t.lora) s.resident = std::max(s.resident, static_cast<uint64_t>(t.lora->rank * t.shape.at(1)) * 4);

    const uint64_t devices = devices_.size();
    const cuda::Staging::Cost host = host_cost(s);
    const uint64_t rss = current_rss_bytes();
    const uint64_t baseline = rss + kReserve + cuda::kLazyKernelHostBytes;
    const uint64_t host_needed = baseline + devices * (host.fixed + host.per_chunk * kChunkStep);
    if (options.memory_limit < host_needed)
      throw usage_error("--memory-limit " + mib(options.memory_limit) + " is below the " + mib(host_needed) +
                        " this process needs at minimum with the CUDA executor on " + std::to_string(devices) +
                        " device(s) (it holds " + mib(rss) + " with the CUDA context" + (devices > 1 ? "s" : "") +
                        (folds ? " and cuBLAS" : "") + " loaded); raise --memory-limit");
    uint64_t chunk = std::min(kMaxChunk, ((options.memory_limit - baseline) / devices - host.fixed) / host.per_chunk);

    const cuda::Staging::Cost device = s.device();
    for (size_t i = 0; i < devices_.size(); ++i) {
      const std::string name = "cuda:" + std::to_string(devices_[i]);
      if (gpu_memory_ > free[i])
        throw usage_error("--gpu-memory " + mib(gpu_memory_) + " is more than " + name + " has free (" + mib(free[i]) + ")");
      const uint64_t budget = gpu_memory_ ? gpu_memory_ : std::min(kDefaultGpuMemory, free[i] / 10 * 8);
      const uint64_t needed = device.fixed + device.per_chunk * kChunkStep;
      if (budget < needed)
        throw usage_error("the CUDA executor needs " + mib(needed) + " of GPU memory on " + name +
                          (folds ? " for this plan's LoRA folds" : "") + ", --gpu-memory allows " + mib(budget));
      chunk = std::min(chunk, (budget - device.fixed) / device.per_chunk);
    }
    s.chunk = chunk / kChunkStep * kChunkStep;
    return s;
  }

  std::vector<int> devices_;
  uint64_t gpu_memory_;
  std::string name_;
  uint64_t chunk_ = 0;
};

}  // namespace

CudaDevices probe_cuda_devices() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess)
    return {0, std::string("cudaGetDeviceCount: ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")"};
  if (count == 0) return {0, "no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES?)"};
  return {count, ""};
}

std::unique_ptr<Executor> make_cuda_executor(std::vector<int> devices, uint64_t gpu_memory) {
  const CudaDevices present = probe_cuda_devices();
  if (present.count == 0) throw usage_error("no CUDA device is usable: " + present.unavailable);
  if (devices.empty())
    for (int d = 0; d < present.count; ++d) devices.push_back(d);
  std::set<int> seen;
  for (int d : devices) {
    if (d < 0 || d >= present.count)
      throw usage_error("cuda:" + std::to_string(d) + ": this machine has " + std::to_string(present.count) +
                        " CUDA device(s), cuda:0 to cuda:" + std::to_string(present.count - 1));
    if (!seen.insert(d).second) throw usage_error("cuda:" + std::to_string(d) + " is listed twice");
  }
  return std::make_unique<CudaExecutor>(std::move(devices), gpu_memory);
}

}  // namespace shardmerge
