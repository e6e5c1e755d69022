// shardmerge-gpu-bench: the CUDA executor against the CPU executor on a synthetic verl FSDP2
// checkpoint, beside the copy ceilings that bound it, printed as an nccl-tests-style table:
//   1. H2D and D2H bandwidth from pinned memory (cudaMemcpyAsync, timed with events);
//   1b. the cast and gather kernels against a device-to-device cudaMemcpy (bytes read + written);
//   2. merge GB/s (bytes read + written per second) of each executor, fp32 shards to bf16;
//   3. the same with PEFT LoRA (rank 64) folded into W: GB/s and fold TFLOP/s.
// Each executor writes into a sink that keeps nothing, so the numbers are read + compute +
// transfer; a separate run of each into memory checks the GPU output against the CPU's.
//   shardmerge-gpu-bench --work /tmp/gpu-bench [--model qwen2.5-1.5b] [--out table.txt]
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "exec/convert_cpu.hpp"
#include "exec/cuda/cuda_executor.hpp"
#include "kernels/cublas_api.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/kernels.hpp"
#include "pipeline/planner.hpp"
#include "shardmerge/error.hpp"
#include "synth/synthetic_fsdp.hpp"
#include "util/rss.hpp"
#include "util/units.hpp"

namespace shardmerge {
namespace {

using Clock = std::chrono::steady_clock;

// Lines go to stdout and to the --out file.
class Report {
 public:
  explicit Report(const std::string& path) {
    if (!path.empty()) file_.open(path);
  }
  template <class... Args>
  void line(const char* format, Args... args) {
    char buf[512];
    std::snprintf(buf, sizeof buf, format, args...);
    std::printf("%s\n", buf);
    std::fflush(stdout);
    if (file_) file_ << buf << "\n" << std::flush;
  }

 private:
  std::ofstream file_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `enqueue` on `stream`, timed with events, after 2 warm-ups.
template <class Enqueue>
double time_on_stream(cudaStream_t stream, int reps, Enqueue&& enqueue) {
  cudaEvent_t start, stop;
  cuda::check(cudaEventCreate(&start), "cudaEventCreate");
  cuda::check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < reps + 2; ++i) {
    cuda::check(cudaEventRecord(start, stream), "cudaEventRecord");
    enqueue();
    cuda::check(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda::check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    cuda::check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(ms);
}

// ---- 1. copy ceilings ------------------------------------------------------------------------

void copy_ceilings(Report& report, int reps) {
  report.line("#");
  report.line("# copy ceilings: pinned host memory <-> device, cudaMemcpyAsync, median of %d after 2 warm-ups", reps);
  report.line("#%14s %10s %12s %10s", "size(B)", "direction", "time(us)", "GB/s");
  const uint64_t largest = 256ull << 20;
  void* host = nullptr;
  void* dev = nullptr;
  cuda::check(cudaHostAlloc(&host, largest, cudaHostAllocDefault), "cudaHostAlloc");
  cuda::check(cudaMalloc(&dev, largest), "cudaMalloc");
  std::memset(host, 0x3C, largest);  // real bytes, and every page touched before timing
  cudaStream_t stream;
  cuda::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  for (uint64_t size : {1ull << 20, 16ull << 20, 64ull << 20, 256ull << 20})
    for (bool h2d : {true, false}) {
      const double m = time_on_stream(stream, reps, [&] {
        cuda::check(h2d ? cudaMemcpyAsync(dev, host, size, cudaMemcpyHostToDevice, stream)
                        : cudaMemcpyAsync(host, dev, size, cudaMemcpyDeviceToHost, stream),
                    "cudaMemcpyAsync");
      });
      report.line(" %14llu %10s %12.1f %10.2f", static_cast<unsigned long long>(size), h2d ? "H2D" : "D2H", m * 1e3,
                  static_cast<double>(size) / (m * 1e-3) / 1e9);
    }
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(host);
}

// ---- 1b. kernels against the device-memory ceiling -------------------------------------------

// The kernel's output (poisoned before the timed runs) against the CPU's conversion of the same
// input: a rate is printed only for a kernel that wrote every byte right.
void expect_equal_on_device(const void* dev, const std::vector<uint8_t>& want, const char* what) {
  std::vector<uint8_t> got(want.size());
  cuda::check(cudaMemcpy(got.data(), dev, got.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  if (got != want) throw Error(std::string(what) + ": the kernel's output differs from the CPU's conversion");
}

// 64 Mi fp32 elements (256 MiB, several times the L2) of random finite values: cudaMemcpy D2D;
// the cast kernel fp32 -> bf16; the gather kernel joining two TP halves [8192, 4096] along dim 1
// into [8192, 8192] bf16 (strided writes, as a TP merge does).
void kernel_rates(Report& report, int reps) {
  const uint64_t rows = 8192, cols = 8192, n = rows * cols, half = cols / 2;
  std::vector<float> input(n);
  uint32_t x = 2463534242u;
  for (float& v : input) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v = static_cast<float>(static_cast<int32_t>(x)) * 1e-9f;
  }
  void* src = nullptr;
  void* dst = nullptr;
  kernels::RegionCopy* regions_dev = nullptr;
  cuda::check(cudaMalloc(&src, n * 4), "cudaMalloc");
  cuda::check(cudaMalloc(&dst, n * 4), "cudaMalloc");
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&regions_dev), 2 * sizeof(kernels::RegionCopy)), "cudaMalloc");
  cuda::check(cudaMemcpy(src, input.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  cudaStream_t stream;
  cuda::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  report.line("#");
  report.line("# device kernels: 64 Mi random fp32 elements, median of %d after 2 warm-ups; GB/s = bytes read + written", reps);
  report.line("#%-40s %12s %10s %12s", "op", "time(us)", "GB/s", "vs memcpy");
  auto row = [&](const char* op, uint64_t bytes, double ms, double ceiling_gbps) {
    const double gbps = static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    report.line(" %-40s %12.1f %10.1f %11.0f%%", op, ms * 1e3, gbps, ceiling_gbps > 0 ? 100.0 * gbps / ceiling_gbps : 100.0);
    return gbps;
  };

  const double copy_ms = time_on_stream(stream, reps, [&] {
    cuda::check(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  const double ceiling = row("cudaMemcpy D2D fp32", 2 * n * 4, copy_ms, 0);

  std::vector<uint8_t> want(n * 2);
  convert_elements(input.data(), DType::F32, 1, want.data(), DType::BF16, n);
  cuda::check(cudaMemset(dst, 0xFF, n * 4), "cudaMemset");
  const double cast_ms = time_on_stream(stream, reps, [&] { kernels::launch_cast(src, DType::F32, dst, DType::BF16, n, stream); });
  expect_equal_on_device(dst, want, "cast fp32 -> bf16");
  row("cast kernel fp32 -> bf16", n * 4 + n * 2, cast_ms, ceiling);

  // Region k is column half k: staged contiguously as [rows, half], landing at column k * half.
  kernels::RegionCopy regions[2];
  const int64_t extent[2] = {static_cast<int64_t>(rows), static_cast<int64_t>(half)};
  const int64_t src_strides[2] = {static_cast<int64_t>(half), 1};
  const int64_t dst_strides[2] = {static_cast<int64_t>(cols), 1};
  for (int k = 0; k < 2; ++k) {
    regions[k] = kernels::describe_region(DType::F32, extent, src_strides, dst_strides, 2, k * rows * half * 4,
                                 static_cast<int64_t>(k * half));
    convert_box(input.data() + k * rows * half, DType::F32, src_strides, want.data() + k * half * 2, DType::BF16,
                dst_strides, extent, 2);
  }
  cuda::check(cudaMemcpy(regions_dev, regions, sizeof regions, cudaMemcpyHostToDevice), "cudaMemcpy");
  cuda::check(cudaMemset(dst, 0xFF, n * 4), "cudaMemset");
  const double gather_ms = time_on_stream(stream, reps, [&] {
    kernels::launch_gather_box(regions_dev, 2, rows * half, static_cast<const uint8_t*>(src), dst, DType::BF16, stream);
  });
  expect_equal_on_device(dst, want, "gather fp32 -> bf16");
  row("gather kernel, 2 TP halves -> bf16", n * 4 + n * 2, gather_ms, ceiling);

  // The fold: W [rows, cols] fp32 += scale * B [rows, rank] @ A [rank, cols], rank 64, in place
  // (W read and written: memory-bound at this rank). 16 rows are checked in double on the CPU.
  const int64_t rank = 64;
  std::vector<float> lora(rank * (rows + cols));
  for (float& v : lora) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v = static_cast<float>(static_cast<int32_t>(x)) * 2e-10f;
  }
  float* lora_dev = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&lora_dev), lora.size() * 4), "cudaMalloc");
  cuda::check(cudaMemcpy(lora_dev, lora.data(), lora.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  cublasHandle_t handle = nullptr;
  cuda::check(cuda::cublas().create(&handle), "cublasCreate");
  cuda::check(cuda::cublas().set_stream(handle, stream), "cublasSetStream");
  kernels::LoraProduct fold;
  fold.rows = static_cast<int64_t>(rows);
  fold.cols = static_cast<int64_t>(cols);
  fold.rank = rank;
  fold.scale = 0.5f;
  fold.part = lora_dev;
  fold.resident = lora_dev + rank * rows;
  fold.w = static_cast<float*>(dst);
  // Each timed fold starts from W = the input (a D2D copy, timed alone too and subtracted).
  const double fold_and_copy_ms = time_on_stream(stream, reps, [&] {
    cuda::check(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    kernels::lora_accumulate(handle, fold);
  });
  std::vector<float> folded(cols);
  for (uint64_t r = 0; r < rows; r += rows / 16) {
    cuda::check(cudaMemcpy(folded.data(), static_cast<float*>(dst) + r * cols, cols * 4, cudaMemcpyDeviceToHost),
                "cudaMemcpy");
    for (uint64_t c = 0; c < cols; ++c) {
      double acc = 0;
      for (int64_t k = 0; k < rank; ++k)
        acc += static_cast<double>(lora[r * rank + k]) * static_cast<double>(lora[rank * rows + k * cols + c]);
      const double want_w = static_cast<double>(input[r * cols + c]) + 0.5 * acc;
      if (std::abs(folded[c] - want_w) > 1e-5 * std::max(1.0, std::abs(want_w)))
        throw Error("cuBLAS fold: W[" + std::to_string(r) + "," + std::to_string(c) + "] is " + std::to_string(folded[c]) +
                    ", the CPU's double-precision fold gives " + std::to_string(want_w));
    }
  }
  const double fold_only_ms = std::max(fold_and_copy_ms - copy_ms, 1e-6);
  row("cuBLAS fold r=64 (W read + written)", 2 * n * 4, fold_only_ms, ceiling);
  report.line("#%-40s %12s %10.1f %s", "", "TFLOP/s", 2.0 * static_cast<double>(n) * rank / (fold_only_ms * 1e-3) / 1e12,
              "(fold time = copy+fold minus copy)");
  cuda::check(cuda::cublas().destroy(handle), "cublasDestroy");
  cudaFree(lora_dev);

  cudaStreamDestroy(stream);
  cudaFree(regions_dev);
  cudaFree(dst);
  cudaFree(src);
}

// ---- 2./3. merges ----------------------------------------------------------------------------

class DiscardSink : public OutputSink {
 public:
  void write(uint32_t, uint64_t, const void*, size_t) const override {}
};

class MemorySink : public OutputSink {
 public:
  explicit MemorySink(const MergePlan& plan) {
    for (const OutputFile& f : plan.files) files.emplace_back(f.size, 0);
  }
  void write(uint32_t file, uint64_t offset, const void* data, size_t n) const override {
    std::memcpy(files[file].data() + offset, data, n);
  }
  mutable std::vector<std::vector<uint8_t>> files;
};

// How far the GPU's output is from the CPU's, tensor by tensor: differing bytes, and for float
// tensors the largest distance in units of the output dtype's last place.
struct Agreement {
  uint64_t bytes_differ = 0;
  int64_t max_ulp = 0;
};

Agreement compare(const MergePlan& plan, const MemorySink& cpu, const MemorySink& gpu) {
  Agreement a;
  for (const OutputTensor& t : plan.tensors) {
    const uint8_t* x = cpu.files[t.file].data() + t.offset;
    const uint8_t* y = gpu.files[t.file].data() + t.offset;
    if (std::memcmp(x, y, t.nbytes) == 0) continue;
    const size_t size = dtype_size(t.dtype);
    for (uint64_t i = 0; i < t.nbytes; i += size) {
      if (std::memcmp(x + i, y + i, size) == 0) continue;
      a.bytes_differ += size;
      if (size > 8) continue;
      int64_t u = 0, v = 0;
      std::memcpy(&u, x + i, size);
      std::memcpy(&v, y + i, size);
      const int64_t sign = int64_t{1} << (8 * size - 1);
      auto ordered = [&](int64_t w) { return (w & sign) ? -(w & (sign - 1)) : w; };
      a.max_ulp = std::max(a.max_ulp, std::abs(ordered(u) - ordered(v)));
    }
  }
  return a;
}

struct Timed {
  double seconds = 0;
  ExecStats stats;
};

Timed time_runs(Executor& e, const MergePlan& plan, const ExecOptions& options, int reps) {
  std::vector<double> secs;
  Timed out;
  DiscardSink sink;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    out.stats = e.run(plan, sink, options);
    secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  out.seconds = median(secs);
  return out;
}

double fold_flops(const MergePlan& plan) {
  double flops = 0;
  for (const OutputTensor& t : plan.tensors)
    if (t.lora) flops += 2.0 * static_cast<double>(t.shape.at(0)) * static_cast<double>(t.shape.at(1)) * static_cast<double>(t.lora->rank);
  return flops;
}

void merge_table(Report& report, const std::string& title, const MergePlan& plan, const ExecOptions& options,
                 Executor& gpu, int reps) {
  auto cpu = make_cpu_executor();
  const double flops = fold_flops(plan);
  report.line("#");
  report.line("# %s: %s read, %s written, %zu tensors%s; median of %d runs into a discarding sink", title.c_str(),
              format_bytes(plan.bytes_read()).c_str(), format_bytes(plan.bytes_written()).c_str(), plan.tensors.size(),
              flops > 0 ? ", LoRA folded" : "", reps);
  // One run of each into memory first: warms the page cache, and gives the comparison.
  MemorySink cpu_out(plan), gpu_out(plan);
  cpu->run(plan, cpu_out, options);
  gpu.run(plan, gpu_out, options);
  const Agreement agree = compare(plan, cpu_out, gpu_out);
  cpu_out.files.clear();
  gpu_out.files.clear();
  report.line("#%-44s %9s %9s %9s %14s", "executor", "seconds", "GB/s", "TFLOP/s", "vs CPU");
  for (Executor* e : {cpu.get(), &gpu}) {
    const Timed t = time_runs(*e, plan, options, reps);
    const double gbps = static_cast<double>(t.stats.bytes_read + t.stats.bytes_written) / t.seconds / 1e9;
    char versus[64] = "reference";
    if (e == &gpu)
      std::snprintf(versus, sizeof versus, agree.bytes_differ == 0 ? "identical" : "%llu B, %lld ulp",
                    static_cast<unsigned long long>(agree.bytes_differ), static_cast<long long>(agree.max_ulp));
    report.line(" %-44s %9.3f %9.2f %9.2f %14s", e->name().c_str(), t.seconds, gbps,
                flops > 0 ? flops / t.seconds / 1e12 : 0.0, versus);
  }
}

PlannedMerge synthetic_plan(const std::string& work, const std::string& model, int64_t world_size, int64_t lora_rank,
                            Report& report) {
  synth::SyntheticOptions o;
  o.out_dir = work + "/" + model + "-w" + std::to_string(world_size) + (lora_rank ? "-lora" + std::to_string(lora_rank) : "");
  o.model = model;
  o.world_size = world_size;
  o.lora_rank = lora_rank;
  if (!std::filesystem::exists(o.out_dir)) {
    const auto t0 = Clock::now();
    const synth::SyntheticSummary s = synth::write_synthetic_fsdp(o);
    report.line("# generated %s: %s of rank files in %.1f s", s.role_dir.c_str(), format_bytes(s.rank_file_bytes).c_str(),
                std::chrono::duration<double>(Clock::now() - t0).count());
  }
  MergeRequest r;
  r.local_dir = o.out_dir;
  r.lora = LoraMode::Fold;
  return plan_merge(r);
}

}  // namespace
}  // namespace shardmerge

int main(int argc, char** argv) {
  using namespace shardmerge;
  CLI::App app{"CUDA executor vs CPU executor on synthetic verl FSDP2 checkpoints, with the copy ceilings"};
  std::string work = "/tmp/shardmerge-gpu-bench", model = "qwen2.5-0.5b", out, memory_limit = "8GiB",
              gpu_memory = "auto";
  int64_t world_size = 8, lora_rank = 64;
  int reps = 3, copy_reps = 20;
  unsigned threads = 0;
  app.add_option("--work", work, "Directory for the synthetic checkpoints (kept for the next run)");
  app.add_option("--model", model, "Model shape (shardmerge-gen --list)");
  app.add_option("--world-size", world_size, "Rank files of the checkpoint");
  app.add_option("--lora-rank", lora_rank, "LoRA rank of the fold benchmark (0: skip it)");
  app.add_option("--reps", reps, "Timed runs per executor (the median is shown)");
  app.add_option("--threads", threads, "Threads of both executors (default: one per core)");
  app.add_option("--memory-limit", memory_limit, "--memory-limit of both executors");
  app.add_option("--gpu-memory", gpu_memory, "--gpu-memory of the CUDA executor (auto: its default)");
  app.add_option("--out", out, "Also write the table to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    Report report(out);
    const CudaDevices present = probe_cuda_devices();
    if (present.count == 0) throw Error("no CUDA device: " + present.unavailable);
    auto gpu = make_cuda_executor({}, gpu_memory == "auto" ? 0 : parse_size(gpu_memory));
    report.line("# shardmerge-gpu-bench: %s, %u host threads", gpu->name().c_str(), std::thread::hardware_concurrency());
    copy_ceilings(report, copy_reps);
    kernel_rates(report, copy_reps);
    ExecOptions options;
    options.threads = threads;
    options.memory_limit = parse_size(memory_limit);
    {
      const PlannedMerge pm = synthetic_plan(work, model, world_size, 0, report);
      merge_table(report, "merge " + model + " fp32 x" + std::to_string(world_size) + " -> bf16", pm.plan, options, *gpu,
                  reps);
    }
    if (lora_rank > 0) {
      const PlannedMerge pm = synthetic_plan(work, model, world_size, lora_rank, report);
      merge_table(report, "merge + LoRA fold r=" + std::to_string(lora_rank) + " " + model, pm.plan, options, *gpu, reps);
    }
    report.line("# peak RSS %.0f MiB", static_cast<double>(peak_rss_bytes()) / (1 << 20));
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "shardmerge-gpu-bench: error: %s\n", e.what());
    return 1;
  }
}
