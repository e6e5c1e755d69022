#include "exec/device.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>

#include "exec/io.hpp"
#include "shardmerge/error.hpp"

#ifdef SHARDMERGE_HAVE_CUDA
#include "exec/cuda/cuda_executor.hpp"
#endif

namespace shardmerge {

DeviceRequest parse_device(const std::string& text) {
  if (text == "cpu") return {DeviceRequest::Kind::Cpu, {}};
  if (text == "auto") return {DeviceRequest::Kind::Auto, {}};
  if (text == "cuda") return {DeviceRequest::Kind::Cuda, {}};
  const std::string prefix = "cuda:";
  if (text.rfind(prefix, 0) != 0)
    throw usage_error("--device " + text + ": expected cpu, cuda, cuda:0,1,... or auto");
  DeviceRequest r{DeviceRequest::Kind::Cuda, {}};
  const char* p = text.data() + prefix.size();
  const char* end = text.data() + text.size();
  while (true) {
    int ordinal = -1;
    const auto [next, ec] = std::from_chars(p, end, ordinal);
    if (ec != std::errc() || ordinal < 0)
      throw usage_error("--device " + text + ": expected device numbers after cuda:, e.g. cuda:0,1");
    r.devices.push_back(ordinal);
    if (next == end) return r;
    if (*next != ',') throw usage_error("--device " + text + ": expected device numbers after cuda:, e.g. cuda:0,1");
    p = next + 1;
  }
}

namespace {

// Bytes read + written per second, measured by bench/gpu_check.sh on an H200 node (16 cores,
// PCIe H2D/D2H 55 GB/s) on 2026-12-04, Qwen2.5-1.5B-shaped fp32 FSDP checkpoint (8 rank files)
// to bf16, from the page cache into a discarding sink (docs/executors.md has the table):
//   CPU executor: 70.6 GB/s for casts and copies (4.4 per core), 29.9 GB/s with LoRA r=64 (1.9 per core);
//   CUDA executor: 19.8 GB/s for casts and copies, 15.0 GB/s with LoRA r=64.
// A merge to disk is bounded by the disk long before either, so ties go to the CPU: it holds
// ~600 MiB less host memory and starts no CUDA context.
constexpr double kCpuBytesPerCore = 4.4e9, kCpuFoldBytesPerCore = 1.9e9;
constexpr double kGpuBytes = 19.8e9, kGpuFoldBytes = 15.0e9;
constexpr double kGpuMustBeFaster = 1.25;

// --threads, or when it is 0 the cores the CPU executor would use.
unsigned cores_of(const Workload& w) { return w.cores ? w.cores : std::max(1u, default_io_threads() / 2); }

[[maybe_unused]] std::string describe(const AutoPrediction& p, const Workload& w) {  // unused without CUDA
  char buf[160];
  const unsigned cores = cores_of(w);
  if (w.bytes == 0)
    std::snprintf(buf, sizeof buf, "%u CPU cores cast %.1f GB/s, one GPU %.1f GB/s (measured rates)", cores,
                  cores * kCpuBytesPerCore / 1e9, kGpuBytes / 1e9);
  else
    std::snprintf(buf, sizeof buf, "predicted %.2f s on %u CPU cores, %.2f s on one GPU", p.cpu_seconds, cores,
                  p.gpu_seconds);
  return buf;
}

}  // namespace

Workload workload_of(const MergePlan& plan, unsigned threads) {
  Workload w;
  w.bytes = plan.bytes_read() + plan.bytes_written();
  for (const OutputTensor& t : plan.tensors) {
    if (!t.lora) continue;
    w.fold_bytes += t.nbytes;
    for (const Slice& s : t.copies) w.fold_bytes += s.numel() * dtype_size(s.dtype);
  }
  w.fold_bytes = std::min(w.fold_bytes, w.bytes);
  w.cores = threads;
  return w;
}

AutoPrediction predict_auto(const Workload& w) {
  const double cores = cores_of(w);
  const double plain = static_cast<double>(w.bytes - std::min(w.fold_bytes, w.bytes));
  const double fold = static_cast<double>(std::min(w.fold_bytes, w.bytes));
  AutoPrediction p;
  p.cpu_seconds = plain / (cores * kCpuBytesPerCore) + fold / (cores * kCpuFoldBytesPerCore);
  p.gpu_seconds = plain / kGpuBytes + fold / kGpuFoldBytes;
  if (w.bytes == 0) {  // unknown plan: compare the rates of plain casts
    p.cpu_seconds = 1 / (cores * kCpuBytesPerCore);
    p.gpu_seconds = 1 / kGpuBytes;
  }
  p.gpu = p.gpu_seconds * kGpuMustBeFaster < p.cpu_seconds;
  return p;
}

ChosenExecutor choose_executor(const DeviceRequest& request, uint64_t gpu_memory, const Workload& workload) {
  if (request.kind == DeviceRequest::Kind::Cpu) return {make_cpu_executor(), "cpu"};
#ifdef SHARDMERGE_HAVE_CUDA
  const CudaDevices present = probe_cuda_devices();
  if (present.count == 0) {
    if (request.kind == DeviceRequest::Kind::Auto)
      return {make_cpu_executor(), "cpu (--device auto: " + present.unavailable + ")"};
    throw usage_error("--device cuda: no CUDA device is usable here (" + present.unavailable +
                      "); --device cpu or auto runs on the CPU");
  }
  std::string why;
  if (request.kind == DeviceRequest::Kind::Auto) {
    const AutoPrediction p = predict_auto(workload);
    why = "--device auto: " + describe(p, workload);
    if (!p.gpu) return {make_cpu_executor(), "cpu (" + why + ")"};
    why = " (" + why + ")";
  }
  auto executor = make_cuda_executor(request.devices, gpu_memory);
  std::string description = executor->name() + why;
  return {std::move(executor), std::move(description)};
#else
  (void)gpu_memory, (void)workload;
  if (request.kind == DeviceRequest::Kind::Auto)
    return {make_cpu_executor(), "cpu (--device auto: this build has no CUDA executor)"};
  throw usage_error("--device cuda: this build of shardmerge has no CUDA executor (rebuild with a CUDA toolkit and "
                    "-DSHARDMERGE_CUDA=ON)");
#endif
}

}  // namespace shardmerge
