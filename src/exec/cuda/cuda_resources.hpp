// Owning handles for what the CUDA executor allocates: device memory, pinned host memory,
// streams, events and a cuBLAS handle. Creation is checked (shardmerge::Error); release cannot
// report failure from a destructor and is best effort, which is all a failing device allows.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/cublas_api.hpp"
#include "kernels/cuda_check.hpp"

namespace shardmerge::cuda {

template <class T, class Release>
class Handle {
 public:
  Handle() = default;
  explicit Handle(T value) : value_(value) {}
  Handle(Handle&& other) noexcept : value_(std::exchange(other.value_, T{})) {}
  Handle& operator=(Handle&& other) noexcept {
    std::swap(value_, other.value_);
    return *this;
  }
  ~Handle() {
    if (value_) Release{}(value_);
  }
  T get() const { return value_; }

 private:
  T value_{};
};

struct FreeDevice {
  void operator()(void* p) const { cudaFree(p); }
};
struct FreePinned {
  void operator()(void* p) const { cudaFreeHost(p); }
};
struct DestroyStream {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct DestroyEvent {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct DestroyCublas {
  void operator()(cublasHandle_t h) const { cublas().destroy(h); }
};

class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(uint64_t bytes) : size_(bytes) {
    void* p = nullptr;
    if (bytes) check(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes >> 20) + " MiB");
    mem_ = Handle<void*, FreeDevice>(p);
  }
  uint8_t* data() const { return static_cast<uint8_t*>(mem_.get()); }
  uint64_t size() const { return size_; }

 private:
  Handle<void*, FreeDevice> mem_;
  uint64_t size_ = 0;
};

// Page-locked host memory: the only kind cudaMemcpyAsync copies without blocking.
class PinnedMemory {
 public:
  PinnedMemory() = default;
  explicit PinnedMemory(uint64_t bytes) : size_(bytes) {
    void* p = nullptr;
    if (bytes)
      check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc of " + std::to_string(bytes >> 20) + " MiB");
    mem_ = Handle<void*, FreePinned>(p);
  }
  uint8_t* data() const { return static_cast<uint8_t*>(mem_.get()); }
  uint64_t size() const { return size_; }

 private:
  Handle<void*, FreePinned> mem_;
  uint64_t size_ = 0;
};

inline Handle<cudaStream_t, DestroyStream> make_stream() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return Handle<cudaStream_t, DestroyStream>(s);
}
using Stream = Handle<cudaStream_t, DestroyStream>;

// Host threads that wait on these events sleep instead of spinning: the same cores run preads.
inline Handle<cudaEvent_t, DestroyEvent> make_event() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreateWithFlags");
  return Handle<cudaEvent_t, DestroyEvent>(e);
}
using Event = Handle<cudaEvent_t, DestroyEvent>;

using Cublas = Handle<cublasHandle_t, DestroyCublas>;

}  // namespace shardmerge::cuda
