// A data plane in rounds, for a transport whose sends and receives must be posted in matching
// order on both sides and cannot be probed for (NCCL): there, a request/reply protocol like the
// MPI one would deadlock. Every process takes part in every round, on a thread of its own, from
// begin_serving until every process has called end_serving. A round is
//  1. an all-gather of how many pieces each process asks of each other one (and whether it is
//     done reading),
//  2. an all-to-all of the requests themselves (source, offset, bytes),
//  3. the owners read what was asked; an all-to-all of the statuses (0, or an error's length),
//  4. an all-to-all of the bytes, and one of the error texts (empty but where a read failed).
// Every process knows every size before each all-to-all, so sends and receives always match.
// A round's bytes are bounded both ways: a reader asks for at most `round_bytes` per round in all
// and at most max(round_bytes / (processes - 1), 1 MiB) of any one owner, so a process receives
// at most `round_bytes` per round and sends at most that too (or (processes - 1) MiB, where
// there are more processes than `round_bytes` has MiB).
//
// The transport is a PeerLink: NCCL between GPUs (nccl_link.hpp); tests run the same rounds over
// threads of one process.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "exec/dist/process_group.hpp"

namespace shardmerge::dist {

// Collective operations among the processes of a merge, on host memory. Every process calls the
// same operations in the same order; the link copies to and from whatever memory it moves.
class PeerLink {
 public:
  virtual ~PeerLink() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // for messages: "NCCL"
  // `n` bytes from every process into `all` (size() * n bytes), in rank order.
  virtual void all_gather(const void* mine, size_t n, void* all) = 0;
  // Sends send[p] to process p and receives recv[p] from process p, for every p at once. The
  // sizes agree pairwise (the caller arranged it); empty spans move nothing.
  virtual void all_to_all(const std::vector<std::span<const char>>& send, const std::vector<std::span<char>>& recv) = 0;
  // Host memory the link moves fastest (page-locked, for a GPU link): `n` bytes for `slot` (0 or
  // 1), reallocated when n grows; valid until the next call for the same slot.
  virtual char* host_buffer(int slot, size_t n) = 0;
};

class RoundExchange final : public DataPlane {
 public:
  static constexpr uint64_t kDefaultRoundBytes = 32ull << 20;

  RoundExchange(std::unique_ptr<PeerLink> link, uint64_t round_bytes = kDefaultRoundBytes);
  ~RoundExchange() override;
  RoundExchange(const RoundExchange&) = delete;
  RoundExchange& operator=(const RoundExchange&) = delete;

  // Blocks until every piece of the read has come back (several rounds for a large read).
  void read(int32_t owner, uint32_t file, uint64_t offset, void* buf, size_t n) override;
  void begin_serving(Serve serve) override;
  void end_serving() override;
  uint64_t bytes_served() const override;
  std::string name() const override { return link_->name(); }

 private:
  struct Read;  // one call of read(): its pieces left, its failure
  struct Piece {
    int32_t owner;
    uint32_t file;
    uint64_t offset;
    uint64_t n;
    char* out;
    Read* read;
  };
  enum class RoundResult { Moved, Idle, Over };  // Over: every process is done
  void run();
  RoundResult round();
  std::vector<std::vector<Piece>> take_pieces();
  void finish(const std::vector<std::vector<Piece>>& asked, const std::vector<std::vector<uint32_t>>& status,
              const std::vector<std::span<char>>& data, const std::vector<std::string>& texts);

  std::unique_ptr<PeerLink> link_;
  const uint64_t round_bytes_;
  const uint64_t owner_bytes_;  // per owner per round, and the largest piece
  Serve serve_;
  std::thread thread_;

  mutable std::mutex mutex_;
  std::condition_variable work_;  // a piece was queued, or end_serving was called
  std::condition_variable done_;  // a read finished, or the exchange stopped
  std::deque<Piece> queue_;
  bool serving_ = false;
  bool ending_ = false;
  uint64_t served_ = 0;
};

}  // namespace shardmerge::dist
