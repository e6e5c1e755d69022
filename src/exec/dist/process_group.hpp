// The processes of one multi-process merge, as the launcher started them: torchrun (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), mpirun (OMPI_COMM_WORLD_*), srun or another
// PMI launcher (PMI_RANK/PMI_SIZE, PMIX_RANK/SLURM_NTASKS). Two transports sit behind one
// interface, so planning and the executors never know which carries them:
//  - MPI (mpi_group.hpp; where shardmerge was built with MPI and an MPI launcher started the
//    processes): collectives for control, point-to-point messages for the data plane;
//  - the TCP bootstrap (tcp_group.hpp; torchrun, or no MPI at build time): control messages only
//    (plan digests, summaries, status); slices move over NCCL where the processes have GPUs
//    (data_plane.hpp), else every source must be readable where it is needed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "shardmerge/error.hpp"
#include "shardmerge/executor.hpp"

namespace shardmerge::dist {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  bool mpi = false;  // an MPI launcher started the processes (mpirun, srun, another PMI launcher)
  std::string address = "127.0.0.1";
  int port = 29501;
  // A peer that answers nothing for this long fails the job (--peer-timeout; the MPI transport).
  double peer_timeout_s = 300;
};

// Reads the launcher's variables; nullopt when this is a single-process run.
std::optional<LaunchInfo> launch_from_environment();

// Moves source bytes between processes: a process asks the owner of a source (a file on its
// node) for a byte range, the owner reads it and sends it back. Two implementations: MPI
// point-to-point (mpi_group.hpp) and NCCL in rounds (round_exchange.hpp, nccl_link.hpp);
// data_plane.hpp chooses.
class DataPlane : public RemoteReader {
 public:
  virtual std::string name() const = 0;  // for messages: "MPI", "NCCL"
  using Serve = std::function<void(uint32_t file, uint64_t offset, void* buf, size_t n)>;
  // From now on answers the other processes' reads with `serve` (on threads of its own; an Error
  // it throws goes back to the asking process as the failure of its read).
  virtual void begin_serving(Serve serve) = 0;
  // Collective: says that this process reads nothing more, keeps serving until every process
  // has said the same, then stops.
  virtual void end_serving() = 0;
  virtual uint64_t bytes_served() const = 0;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return info_.rank; }
  int size() const { return info_.world_size; }
  int local_rank() const { return info_.local_rank; }
  double peer_timeout_s() const { return info_.peer_timeout_s; }
  virtual std::string transport() const = 0;  // for messages: "MPI", "TCP bootstrap"

  // Every process contributes a blob and gets everyone's, in rank order. A process that
  // failed contributes its error instead (ok = false): then every process throws an Error
  // naming the failed rank and its message, so all stop at the same point.
  virtual std::vector<std::string> all_gather(const std::string& mine, bool ok = true) = 0;
  // Rank 0's blob, everywhere (with the same error semantics).
  std::string broadcast(const std::string& from_root, bool ok = true);
  // Whether a peer stopped answering (the job is ending without it).
  virtual bool peer_lost() const { return false; }
  // This transport's own data plane (MPI point-to-point); null when it carries control messages
  // only.
  virtual DataPlane* data_plane() { return nullptr; }

 protected:
  explicit ProcessGroup(const LaunchInfo& info) : info_(info) {}
  LaunchInfo info_;
};

// How a collective step's result travels: a std::string as its bytes (a codec's blob, e.g. the
// node summaries of layouts/summary_codec.hpp), any other type as the CBOR of its JSON form
// (nlohmann's to_json/from_json: NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE for a struct).
template <typename T>
std::string encode_message(const T& value) {
  if constexpr (std::is_same_v<T, std::string>) {
    return value;
  } else {
    const std::vector<uint8_t> cbor = nlohmann::json::to_cbor(nlohmann::json(value));
    return std::string(cbor.begin(), cbor.end());
  }
}
template <typename T>
T decode_message(const std::string& bytes, int from_rank) {
  if constexpr (std::is_same_v<T, std::string>) {
    return bytes;
  } else {
    try {
      return nlohmann::json::from_cbor(bytes).get<T>();
    } catch (const nlohmann::json::exception& e) {
      throw Error("process rank " + std::to_string(from_rank) + " sent a message this process cannot read (" + e.what() +
                  "): are all processes the same shardmerge?");
    }
  }
}

// Runs `step` here, then exchanges its result (a value of the type it returns, or nothing), or
// its error, with every process: all return everyone's results in rank order, or all throw the
// first failure. Every collective step of a multi-process merge goes through this, so that a
// process that fails never leaves the others waiting in a different collective.
template <typename Step>
auto run_together(ProcessGroup& group, Step step) {
  using Result = std::invoke_result_t<Step>;
  std::string out;
  bool ok = true;
  try {
    if constexpr (std::is_void_v<Result>) {
      step();
    } else {
      out = encode_message(step());
    }
  } catch (const std::exception& e) {
    ok = false;
    out = e.what();
  }
  const std::vector<std::string> all = group.all_gather(out, ok);
  if constexpr (!std::is_void_v<Result>) {
    std::vector<Result> results;
    results.reserve(all.size());
    for (size_t r = 0; r < all.size(); ++r) results.push_back(decode_message<Result>(all[r], static_cast<int>(r)));
    return results;
  }
}

// The group for `info`: MPI where built with it and an MPI launcher started the processes, else
// the TCP bootstrap (connecting waits up to `timeout_s` for every process).
std::unique_ptr<ProcessGroup> join_process_group(const LaunchInfo& info, int timeout_s = 120);

}  // namespace shardmerge::dist
