#include "exec/device.hpp"

#include <charconv>

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

ChosenExecutor choose_executor(const DeviceRequest& request, uint64_t gpu_memory) {
  if (request.kind == DeviceRequest::Kind::Cpu) return {make_cpu_executor(), "cpu"};
#ifdef SHARDMERGE_HAVE_CUDA
  const CudaDevices present = probe_cuda_devices();
  if (present.count == 0) {
    if (request.kind == DeviceRequest::Kind::Auto)
      return {make_cpu_executor(), "cpu (--device auto: " + present.unavailable + ")"};
    throw usage_error("--device cuda: no CUDA device is usable here (" + present.unavailable +
                      "); --device cpu or auto runs on the CPU");
  }
  auto executor = make_cuda_executor(request.devices, gpu_memory);
  std::string description = executor->name();
  return {std::move(executor), std::move(description)};
#else
  (void)gpu_memory;
  if (request.kind == DeviceRequest::Kind::Auto)
    return {make_cpu_executor(), "cpu (--device auto: this build has no CUDA executor)"};
  throw usage_error("--device cuda: this build of shardmerge has no CUDA executor (rebuild with a CUDA toolkit and "
                    "-DSHARDMERGE_CUDA=ON)");
#endif
}

}  // namespace shardmerge
