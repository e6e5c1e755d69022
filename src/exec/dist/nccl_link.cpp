#include "exec/dist/nccl_link.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "exec/cuda/cuda_resources.hpp"
#include "exec/dist/nccl_api.hpp"
#include "shardmerge/error.hpp"

namespace shardmerge::dist {
namespace {

using cuda::check;

class NcclLink final : public PeerLink {
 public:
  NcclLink(int rank, int size, int device, const ShareId& share_id, double peer_timeout_s)
      : rank_(rank), size_(size), device_(device), peer_timeout_(peer_timeout_s) {
    // What can fail here fails on every process together (the exchange of the id carries it),
    // before ncclCommInitRank, which would wait for ever for a process that never calls it.
    ncclUniqueId id{};
    std::string mine;
    bool ok = true;
    try {
      check(cudaSetDevice(device_), "cudaSetDevice");
      stream_ = cuda::make_stream();
      if (rank_ == 0) {
        check_nccl(nccl().get_unique_id(&id), "ncclGetUniqueId");
        mine.assign(id.internal, sizeof id.internal);
      }
    } catch (const std::exception& e) {
      mine = e.what();
      ok = false;
    }
    const std::string shared = share_id(mine, ok);
    if (shared.size() != sizeof id.internal)
      throw Error("NCCL: rank 0's unique id arrived with " + std::to_string(shared.size()) + " bytes, not " +
                  std::to_string(sizeof id.internal));
    std::memcpy(id.internal, shared.data(), sizeof id.internal);
    check_nccl(nccl().comm_init_rank(&comm_, size_, id, rank_),
               "ncclCommInitRank (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + " on cuda:" +
                   std::to_string(device_) + ")");
  }
  ~NcclLink() override {
    if (comm_) nccl().comm_destroy(comm_);
  }
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "NCCL"; }

  void all_gather(const void* mine, size_t n, void* all) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    const uint64_t total = n * static_cast<uint64_t>(size_);
    reserve(recv_, total);
    uint8_t* slot = recv_.data() + n * static_cast<uint64_t>(rank_);
    check(cudaMemcpyAsync(slot, mine, n, cudaMemcpyHostToDevice, stream_.get()), "cudaMemcpyAsync (all-gather)");
    check_nccl(nccl().all_gather(slot, recv_.data(), n, ncclUint8, comm_, stream_.get()), "ncclAllGather", comm_);
    check(cudaMemcpyAsync(all, recv_.data(), total, cudaMemcpyDeviceToHost, stream_.get()), "cudaMemcpyAsync (all-gather)");
    synchronize("ncclAllGather");
  }

  void all_to_all(const std::vector<std::span<const char>>& send, const std::vector<std::span<char>>& recv) override {
    uint64_t sending = 0, receiving = 0;
    for (const auto& s : send) sending += s.size();
    for (const auto& r : recv) receiving += r.size();
    if (sending == 0 && receiving == 0) return;  // point-to-point: peers with nothing to move take no part
    check(cudaSetDevice(device_), "cudaSetDevice");
    reserve(send_, sending);
    reserve(recv_, receiving);
    uint64_t at = 0;
    for (const auto& s : send) {
      if (!s.empty())
        check(cudaMemcpyAsync(send_.data() + at, s.data(), s.size(), cudaMemcpyHostToDevice, stream_.get()),
              "cudaMemcpyAsync (to send)");
      at += s.size();
    }
    check_nccl(nccl().group_start(), "ncclGroupStart", comm_);
    uint64_t out = 0, in = 0;
    for (int p = 0; p < size_; ++p) {
      const auto& s = send[static_cast<size_t>(p)];
      const auto& r = recv[static_cast<size_t>(p)];
      if (!s.empty()) check_nccl(nccl().send(send_.data() + out, s.size(), ncclUint8, p, comm_, stream_.get()), "ncclSend", comm_);
      if (!r.empty()) check_nccl(nccl().recv(recv_.data() + in, r.size(), ncclUint8, p, comm_, stream_.get()), "ncclRecv", comm_);
      out += s.size();
      in += r.size();
    }
    check_nccl(nccl().group_end(), "ncclGroupEnd (send/receive)", comm_);
    at = 0;
    for (const auto& r : recv) {
      if (!r.empty())
        check(cudaMemcpyAsync(r.data(), recv_.data() + at, r.size(), cudaMemcpyDeviceToHost, stream_.get()),
              "cudaMemcpyAsync (received)");
      at += r.size();
    }
    synchronize("ncclSend/ncclRecv");
  }

  char* host_buffer(int slot, size_t n) override {
    cuda::PinnedMemory& m = host_.at(static_cast<size_t>(slot));
    if (m.size() < n) {
      check(cudaSetDevice(device_), "cudaSetDevice");
      m = cuda::PinnedMemory(0);  // the old one goes first: the two need not fit together
      m = cuda::PinnedMemory(std::max<uint64_t>(n, 1ull << 20));
    }
    return reinterpret_cast<char*>(m.data());
  }

 private:
  // Device memory for at least n bytes; grows by doubling so that a few rounds settle its size.
  void reserve(cuda::DeviceMemory& m, uint64_t n) {
    const uint64_t had = m.size();
    if (had >= n) return;
    synchronize("growing a device buffer");
    m = cuda::DeviceMemory(0);
    m = cuda::DeviceMemory(std::max<uint64_t>({n, 2 * had, 1ull << 20}));
  }
  // Waits for the stream without spinning a core (cudaStreamSynchronize spins by default), and
  // for at most the peer timeout: a peer that stopped leaves NCCL waiting for ever.
  void synchronize(const char* what) {
    const auto start = std::chrono::steady_clock::now();
    for (unsigned i = 0;; ++i) {
      const cudaError_t e = cudaStreamQuery(stream_.get());
      if (e != cudaErrorNotReady) return check(e, std::string("waiting for ") + what);
      ncclResult_t async = ncclSuccess;
      check_nccl(nccl().comm_get_async_error(comm_, &async), "ncclCommGetAsyncError", comm_);
      check_nccl(async, what, comm_);
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      if (waited.count() > peer_timeout_) {
        nccl().comm_abort(comm_);  // ends the kernels waiting on the silent peer
        comm_ = nullptr;
        throw Error("NCCL: " + std::string(what) + " made no progress for " + std::to_string(static_cast<long>(waited.count())) +
                    " s (--peer-timeout): a process is stopped or its network is down");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000u, 10u << std::min(i, 7u))));
    }
  }

  int rank_, size_, device_;
  double peer_timeout_;
  ncclComm_t comm_ = nullptr;
  cuda::Stream stream_;
  cuda::DeviceMemory send_, recv_;
  std::array<cuda::PinnedMemory, 2> host_;
};

std::string hex(const unsigned char* bytes, size_t n) {
  std::string out;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", bytes[i]);
    out += b;
  }
  return out;
}

}  // namespace

NcclProbe probe_nccl(int local_rank) {
  NcclProbe probe;
  try {
    nccl();
  } catch (const Error& e) {
    probe.problem = e.message();
    return probe;
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    probe.problem = std::string("no CUDA device") + (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : "");
    return probe;
  }
  probe.device = count == 1 ? 0 : local_rank;
  if (probe.device >= count) {
    probe.problem = "local rank " + std::to_string(local_rank) + " but only " + std::to_string(count) +
                    " visible GPUs: NCCL needs one GPU per process";
    return probe;
  }
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, probe.device); e != cudaSuccess) {
    probe.problem = std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(e);
    return probe;
  }
  probe.gpu = hex(reinterpret_cast<const unsigned char*>(prop.uuid.bytes), sizeof prop.uuid.bytes);
  return probe;
}

std::unique_ptr<PeerLink> make_nccl_link(int rank, int size, int device, const ShareId& share_id, double peer_timeout_s) {
  return std::make_unique<NcclLink>(rank, size, device, share_id, peer_timeout_s);
}

}  // namespace shardmerge::dist
